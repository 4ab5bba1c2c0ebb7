"""Issue #35, rule 3: everything finished is checksummed and checked before use. A checkpoint records the
sha256 of its files (and of its own state) when it is written; resume checks them, and a damaged newest
checkpoint falls back to the previous complete one with one warning naming it. An export records the sha256 of
its files in export_manifest.json when it is published; `stage=all`/`stage=export` rebuild a damaged one (one
warning naming the file), evaluate refuses it in one line."""

import hashlib
import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file

from pipeline.errors import UserError
from pipeline.formats import checkpoint as ckpt
from pipeline.runner import run_stages
from pipeline.serving import launch

pytestmark = pytest.mark.slow
# steps 5 and 10 are checkpointed; the export skips the engines' own classes (their checks are test_export's)
RUN = [
    "+experiment=tiny",
    "data.limit=16",
    "train.max_steps=10",
    "train.save_every_steps=5",
    "train.keep_last=3",
    "export.verify_in_engine=false",
]


@pytest.fixture(scope="module")
def base(make_cfg, tmp_path_factory):
    """One tiny run through export, never damaged: each test damages a copy of it."""
    run_dir = tmp_path_factory.mktemp("checksummed")
    for stage in ("prepare", "extract", "vocab", "train", "export"):
        run_stages(make_cfg(*RUN, f"stage={stage}", run_dir=run_dir))
    return run_dir


@pytest.fixture
def run(base, tmp_path):
    shutil.copytree(base, tmp_path / "run")  # copy2: mtimes kept, so every stage is up to date in the copy
    return tmp_path / "run"


def flip(path, at=None):
    data = bytearray(path.read_bytes())
    at = len(data) * 3 // 4 if at is None else at  # past safetensors' header, inside the tensors' bytes
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def damage_warnings(caplog, name) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and name in r.getMessage()]


@pytest.mark.parametrize(
    "file,how",
    [
        ("model.safetensors", flip),
        ("optimizer.bin", flip),
        ("model.safetensors", truncate),
        ("train_state.json", truncate),
    ],
)
def test_checksummed_a_damaged_newest_checkpoint_falls_back_to_the_previous_one_with_one_warning(
    make_cfg, run, base, caplog, file, how
):
    """A flipped byte or a cut file in step_000010 (resumed in silence, or a traceback, before): skipped with
    one warning naming it; step_000005 is resumed, and the final weights equal the uninterrupted run's."""
    shutil.rmtree(run / "train" / "final")  # so stage=train runs again and resumes
    how(run / "train" / "step_000010" / file)
    caplog.set_level(logging.INFO)
    run_stages(make_cfg(*RUN, "stage=train", run_dir=run))
    warned = damage_warnings(caplog, "step_000010")
    assert len(warned) == 1 and file in warned[0] and "step_000005" in warned[0], warned
    assert f"train: resumed from {run / 'train' / 'step_000005'}" in caplog.text
    a = load_file(str(base / "train" / "final" / "model.safetensors"))
    b = load_file(str(run / "train" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the damaged step was trained again and written whole
    assert [(d.name, ckpt.damage(d, state)) for d, state in ckpt.candidates(run / "train")] == [
        ("step_000010", None),
        ("step_000005", None),
    ]


def test_checksummed_no_intact_checkpoint_is_one_line_naming_them_and_the_fix(make_cfg, run):
    shutil.rmtree(run / "train" / "final")
    flip(run / "train" / "step_000010" / "model.safetensors")
    truncate(run / "train" / "step_000005" / "optimizer.bin")
    with pytest.raises(UserError) as e:
        run_stages(make_cfg(*RUN, "stage=train", run_dir=run))
    line = str(e.value)
    assert "\n" not in line and "step_000010" in line and "step_000005" in line, line
    assert "train.resume=never" in line
    assert (run / "train" / "step_000010").is_dir()  # refused, nothing deleted


def test_checksummed_a_checkpoint_written_without_checksums_is_refused_in_one_line(make_cfg, run):
    """No compatibility path: a checkpoint from before the checksums is refused like other old schemas."""
    shutil.rmtree(run / "train" / "final")
    path = run / "train" / "step_000010" / "train_state.json"
    state = json.loads(path.read_text())
    state.pop("checksums")
    state.pop("state_sha256")
    path.write_text(json.dumps(state))
    with pytest.raises(UserError, match="written by an older eaglepipe .no checksums.*train.resume=never"):
        run_stages(make_cfg(*RUN, "stage=train", run_dir=run))


@pytest.mark.parametrize(
    "file,how",
    [
        ("model.safetensors", truncate),
        ("model.safetensors", flip),
        ("config.json", lambda p: p.write_text(p.read_text().replace('"num_hidden_layers": 1', '"x": 1'))),
        ("serve.sh", lambda p: p.write_text(p.read_text() + "--speculative-num-steps 9\n")),
        ("export_manifest.json", truncate),
    ],
)
def test_checksummed_a_damaged_export_is_rebuilt_by_the_next_run_with_one_warning(
    make_cfg, run, base, caplog, file, how
):
    """An export cut or edited after it was published was "up to date" for stage=all/export: now rebuilt."""
    how(run / "export" / "sglang" / file)
    caplog.set_level(logging.INFO)
    run_stages(make_cfg(*RUN, "stage=export", run_dir=run))
    warned = damage_warnings(caplog, file)
    assert len(warned) == 1 and "export/sglang" in warned[0], warned
    assert "stage export: up to date" not in caplog.text
    for name in ("model.safetensors", "config.json"):
        assert (run / "export/sglang" / name).read_bytes() == (base / "export/sglang" / name).read_bytes()
    caplog.clear()
    run_stages(make_cfg(*RUN, "stage=export", run_dir=run))  # intact again: skipped
    assert "stage export: up to date" in caplog.text


def test_checksummed_evaluate_of_a_damaged_export_is_one_line(make_cfg, run):
    flip(run / "export" / "sglang" / "model.safetensors")
    with pytest.raises(UserError) as e:
        run_stages(make_cfg(*RUN, "stage=evaluate", run_dir=run))
    line = str(e.value)
    assert "\n" not in line and str(run / "export" / "sglang" / "model.safetensors") in line, line
    assert "stage=export" in line


def test_checksummed_tune_serve_rewriting_serve_sh_keeps_the_export_intact(make_cfg, run, caplog):
    """tune-serve rewrites serve.sh after publish: its digest is recorded again, so the export stays fresh."""
    folder = run / "export" / "sglang"
    manifest = json.loads((folder / "export_manifest.json").read_text())
    serve = {**manifest["serve"], "num_steps": 2, "sglang_args": [], "vllm_args": []}
    launch.write_serve(folder, "sglang", manifest["target_path"], folder, serve, {"by": "measurement"})
    recorded = json.loads((folder / "export_manifest.json").read_text())["files"]["serve.sh"]
    assert recorded["sha256"] == hashlib.sha256((folder / "serve.sh").read_bytes()).hexdigest()
    caplog.set_level(logging.INFO)
    run_stages(make_cfg(*RUN, "stage=export", run_dir=run))
    assert "stage export: up to date" in caplog.text
