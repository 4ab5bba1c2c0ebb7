"""Bad inputs that once ended in a traceback (#12 B15-B22, Hydra's own errors): each is one line
`eaglepipe: error: ...` and exit code 2, or a verify problem, never a traceback."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.engines.verify import check_export
from pipeline.errors import UserError
from pipeline.stages import export
from pipeline.tools import verify

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
RUN = ["+experiment=tiny", "data.limit=16", "train.max_steps=4"]  # the exported_run fixture's overrides


def cli(*args, cache_dir, prefix=()):
    return subprocess.run(
        [sys.executable, *prefix, "-m", "pipeline", *args, f"cache_dir={cache_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def one_error_line(r) -> str:
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("eaglepipe: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return errors[0]


def test_data_path_that_is_a_directory_is_one_line(tmp_path, cache_dir):
    (tmp_path / "data").mkdir()
    r = cli(
        "stage=prepare",
        "target=tiny",
        "data=sharegpt",
        f"data.path={tmp_path / 'data'}",
        f"run_dir={tmp_path / 'run'}",
        cache_dir=cache_dir,
    )
    assert "is a directory; data=sharegpt reads one .json or .jsonl file" in one_error_line(r)


def test_run_dir_that_is_a_file_is_one_line(tmp_path, cache_dir):
    (tmp_path / "run").write_text("not a folder")
    r = cli("stage=prepare", "target=tiny", f"run_dir={tmp_path / 'run'}", cache_dir=cache_dir)
    assert f"{tmp_path / 'run'} is a file, not a directory; pick another run_dir" in one_error_line(r)
    assert (tmp_path / "run").read_text() == "not a folder"


# Root ignores permission bits, so the read-only run dir is a log file that cannot be opened (EACCES), the
# way a read-only dir fails for any other user.
DENY_LOG = (
    "import errno, logging, runpy, sys\n"
    "def deny(self): raise PermissionError(errno.EACCES, 'Permission denied', self.baseFilename)\n"
    "logging.FileHandler._open = deny; sys.argv[0] = 'pipeline'; runpy.run_module('pipeline', "
    "run_name='__main__')"
)


def test_run_dir_that_is_not_writable_is_one_line(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            DENY_LOG,
            "stage=prepare",
            "target=tiny",
            f"run_dir={run_dir}",
            f"cache_dir={cache_dir}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    line = one_error_line(r)
    assert f"cannot write the log file {run_dir}/__main__.log (Permission denied)" in line, line
    assert not (run_dir / "prepared").exists()


def test_target_base_target_is_one_line(tmp_path, cache_dir):
    r = cli("stage=prepare", "target=base_target", f"run_dir={tmp_path}", cache_dir=cache_dir)
    line = one_error_line(r)
    assert (
        "target=base_target is the schema every target/*.yaml builds on" in line and "smollm2, tiny" in line
    )


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.nokey=1", "train.nokey is not a setting of eaglepipe"),
        ("data.limit=[1", "override 'data.limit=[1': no viable alternative"),
        ("target=nope", "Could not find 'target/nope'; Available options in 'target': kimi_k25,"),
        ("train.lr=abc", "Value 'abc' of type 'str' could not be converted to Float"),
    ],
    ids=["unknown-key", "override-grammar", "unknown-group-option", "wrong-type"],
)
def test_hydra_composition_errors_are_one_line_exit_2(tmp_path, cache_dir, override, message):
    r = cli("stage=prepare", "target=tiny", f"run_dir={tmp_path}", override, cache_dir=cache_dir)
    line = one_error_line(r)
    assert message in line, line
    assert "base_target" not in line and "HYDRA_FULL_ERROR" not in r.stderr


def test_truncated_final_weights_then_export_is_one_line(exported_run, make_cfg, tmp_path):
    run_dir, _ = exported_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("export"))
    weights = copy / "train/final/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(
        UserError,
        match=r"the trained draft in .*final cannot be read \(SafetensorError.*"
        r"delete .*final and rerun stage=train",
    ):
        export.run(make_cfg(*RUN, "stage=export", run_dir=copy))
    assert not (copy / "export").exists()


@pytest.mark.parametrize("key", ["num_attention_heads", "intermediate_size"])
def test_verify_of_an_export_lacking_a_layer_key_is_a_problem_not_a_keyerror(
    exported_run, mutate, tmp_path, key
):
    run_dir, facts = exported_run
    bad = mutate(run_dir / "export/sglang", tmp_path / "sglang", config=lambda c: c.pop(key))
    assert any(
        f"config.json lacks {key}: SGLang cannot build the draft layer" in p
        for p in check_export(bad, "sglang", facts)
    )


def test_verify_of_an_export_without_model_safetensors_is_one_line(exported_run, make_cfg, tmp_path, capsys):
    run_dir, facts = exported_run
    folder = tmp_path / "sglang"
    shutil.copytree(run_dir / "export/sglang", folder)
    (folder / "model.safetensors").unlink()
    assert any(
        "model.safetensors cannot be read (FileNotFoundError" in p
        for p in check_export(folder, "sglang", facts)
    )
    with pytest.raises(UserError, match="1 of 1 export"):
        verify.run(make_cfg("stage=verify", f"export_dir={folder}"))
    assert "verify: sglang: model.safetensors cannot be read" in capsys.readouterr().out
    assert json.loads((folder / "export_manifest.json").read_text())["engine"] == "sglang"
    assert os.listdir(folder)  # nothing deleted


# ---- B3: a vocab of another size on a finished run
def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def finished_copy(exported_run, tmp_path):
    run_dir, _ = exported_run
    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


def test_stage_all_with_another_draft_vocab_size_is_refused_before_anything_is_replaced(
    finished_copy, make_cfg
):
    from pipeline.runner import run_stages

    before = {d: _tree(finished_copy / d) for d in ("vocab", "train", "export")}
    with pytest.raises(
        UserError,
        match=r"vocab.draft_vocab_size=128 would rebuild .*vocab \(now 256 tokens\).*"
        r"add train.resume=never",
    ):
        run_stages(make_cfg(*RUN, "vocab.draft_vocab_size=128", run_dir=finished_copy))
    assert {d: _tree(finished_copy / d) for d in before} == before


def test_resuming_checkpoints_of_another_vocab_size_is_one_line_and_resume_never_retrains(
    finished_copy, make_cfg
):
    from pipeline.runner import run_stages

    run_stages(make_cfg(*RUN, "vocab.draft_vocab_size=128", "stage=vocab", run_dir=finished_copy))
    steps = sorted(p.name for p in (finished_copy / "train").glob("step_*"))
    with pytest.raises(UserError, match="was trained on other inputs or another train config"):
        run_stages(make_cfg(*RUN, "vocab.draft_vocab_size=128", "stage=train", run_dir=finished_copy))
    assert sorted(p.name for p in (finished_copy / "train").glob("step_*")) == steps  # nothing deleted
    run_stages(
        make_cfg(
            *RUN, "vocab.draft_vocab_size=128", "stage=train", "train.resume=never", run_dir=finished_copy
        )
    )
    from safetensors.torch import load_file

    assert load_file(str(finished_copy / "train/final/model.safetensors"))["d2t"].shape == (128,)
