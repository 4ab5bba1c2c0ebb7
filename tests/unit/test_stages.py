"""The stage runner (pipeline/stages.py) on fabricated run dirs: no stage does real work here."""

import json
import logging

from pipeline import vocab
from pipeline.stages import run_stages, write_record


def test_a_skipped_stage_whose_input_is_gone_says_so(make_cfg, tmp_path, caplog):
    """Deleting features/manifest.json then stage=vocab (or train) once said only "up to date, skipped"."""
    cfg = make_cfg("+experiment=tiny", "stage=vocab", run_dir=tmp_path)
    (tmp_path / "vocab").mkdir()
    (tmp_path / "vocab" / "manifest.json").write_text(json.dumps({"draft_vocab_size": 256}))
    write_record(tmp_path, "vocab", {"fingerprint": vocab.fingerprint(cfg)})  # as if built, then features deleted
    caplog.set_level(logging.INFO)
    run_stages(cfg)
    assert "stage vocab: up to date" in caplog.text
    assert f"1 of its inputs are gone ({tmp_path}/features/manifest.json)" in caplog.text
