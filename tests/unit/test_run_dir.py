"""RunDir names every folder of a run once, and opens the feature store checked (#11 item 2)."""

import json

import pytest

from pipeline.errors import UserError
from pipeline.formats import feature_store as fs
from pipeline.formats.run_dir import RunDir


def test_folders_follow_the_documented_layout(tmp_path):
    rd = RunDir(tmp_path)
    assert [
        p.name for p in (rd.prepared, rd.features, rd.vocab, rd.train, rd.exports, rd.eval, rd.parity)
    ] == ["prepared", "features", "vocab", "train", "export", "eval", "parity"]
    assert rd.final == tmp_path / "train" / "final" and rd.export("vllm") == tmp_path / "export" / "vllm"
    assert (rd.stages_json.name, rd.summary_md.name) == ("stages.json", "summary.md")


def test_no_store_is_one_line_naming_the_stage_to_run(tmp_path):
    with pytest.raises(UserError, match="no feature store.*run stage=extract first"):
        RunDir(tmp_path).open_features()


def test_an_incomplete_store_is_refused_unless_asked_for(tmp_path):
    rd = RunDir(tmp_path)
    rd.features.mkdir()
    (rd.features / fs.MANIFEST).write_text(
        json.dumps(
            {
                "format": fs.FORMAT,
                "schema_version": fs.SCHEMA_VERSION,
                "facts": {},
                "shards": [],
                "complete": False,
            }
        )
    )
    with pytest.raises(UserError, match="is incomplete; rerun stage=extract"):
        rd.open_features()
    assert len(rd.open_features(complete=False)) == 0
