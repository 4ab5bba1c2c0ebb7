"""The command line: stage runner (skip / redo), one-line user errors with exit code 2, multirun."""

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.runner import read_records, run_stages

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def cli(*args, cache_dir):
    flags = [a for a in args if a.startswith("-")]  # Hydra wants -m before the overrides
    overrides = [a for a in args if not a.startswith("-")]
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *flags, f"cache_dir={cache_dir}", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_stage_all_skips_fresh_stages_and_redoes_what_changed(make_cfg, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    cfg = make_cfg("+experiment=tiny", "data.limit=4", run_dir=tmp_path)
    run_stages(cfg)
    first = read_records(tmp_path)
    assert set(first) == {"prepare", "extract", "vocab", "train", "export", "evaluate"}
    summary = (tmp_path / "summary.md").read_text()  # the closing table, read back from what the stages wrote
    table = {
        line.split(" | ")[0][2:]: line
        for line in summary.splitlines()
        if line.startswith("| ") and " s |" in line
    }
    assert list(table) == ["prepare", "extract", "vocab", "train", "export", "evaluate"], summary
    stats = json.loads((tmp_path / "prepared" / "stats.json").read_text())
    assert f"{stats['samples']} samples, {stats['tokens']:,} tokens" in table["prepare"]
    assert "aux layers [1, 3, 4] + last of 8" in table["extract"] and "val acc_0/1/2 " in table["train"]
    assert "loaded by LlamaForCausalLMEagle3 (sglang 0.5.23)" in table["export"]
    assert (
        "loaded by Eagle3LlamaForCausalLM (vllm 0.33.0)" in table["export"]
        and "trained " in table["evaluate"]
    )
    assert str(tmp_path / "eval" / "tau.png") in summary and "up to date" not in summary
    caplog.clear()
    run_stages(cfg)
    for stage in first:
        assert f"stage {stage}: up to date" in caplog.text
    assert read_records(tmp_path) == first
    assert (tmp_path / "summary.md").read_text().count("(up to date, skipped)") == 6
    # more data: prepare is redone; extract refuses to mix features from the old prepared set ...
    changed = make_cfg("+experiment=tiny", "data.limit=5", run_dir=tmp_path)
    with pytest.raises(UserError, match="prepared_fingerprint.*extract.overwrite=true"):
        run_stages(changed)
    assert read_records(tmp_path)["prepare"]["fingerprint"] != first["prepare"]["fingerprint"]
    # ... until told to replace them; then training refuses checkpoints of the old features the same way
    with pytest.raises(UserError, match="trained on other inputs.*train.resume=never"):
        run_stages(make_cfg("+experiment=tiny", "data.limit=5", "extract.overwrite=true", run_dir=tmp_path))
    # train alone: export and evaluate after it run the first run's code path again (engines' verify too)
    run_stages(
        make_cfg("+experiment=tiny", "data.limit=5", "train.resume=never", "stage=train", run_dir=tmp_path)
    )
    assert read_records(tmp_path)["train"]["fingerprint"] != first["train"]["fingerprint"]
    assert json.loads((tmp_path / "features" / "manifest.json").read_text())["facts"]["num_samples"] == 5


def test_an_incomplete_stage_is_not_skipped(make_cfg, tmp_path):
    cfg = make_cfg("+experiment=tiny", "data.limit=3", "stage=extract", run_dir=tmp_path)
    run_stages(make_cfg("+experiment=tiny", "data.limit=3", "stage=prepare", run_dir=tmp_path))
    run_stages(cfg)
    manifest = tmp_path / "features" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["complete"] = False
    manifest.write_text(json.dumps(m))
    run_stages(cfg)
    assert json.loads(manifest.read_text())["complete"] is True


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["target=llama3_8b", "target.path=/nonexistent/model", "stage=prepare"],
            "target path /nonexistent/model does not exist",
        ),
        (
            ["target=tiny", "stage=extract", "extract.aux_layers=[1,8]"],
            r"aux layer ids \[8\] outside \[0, 7\]",
        ),
        (["target=tiny", "stage=evaluate"], "run stage=export first"),
        (["target=tiny", "stage=train"], "run stage=extract first"),
        (["target=tiny", "stage=extract"], "run stage=prepare first"),
        (["target=tiny", "data=sharegpt", "data.path=/nonexistent.jsonl", "stage=prepare"], "does not exist"),
    ],
)
def test_user_mistakes_exit_2_with_one_line_and_no_traceback(tmp_path, cache_dir, args, message):
    if any("aux_layers" in a for a in args):
        assert (
            cli(
                "target=tiny", "stage=prepare", "data.limit=2", f"run_dir={tmp_path}", cache_dir=cache_dir
            ).returncode
            == 0
        )
    r = cli(*args, f"run_dir={tmp_path}", "data.limit=2", cache_dir=cache_dir)
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("eaglepipe: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr
    assert re.search(message, errors[0]), errors[0]


def test_multirun_sweeps_into_separate_run_dirs(tmp_path, cache_dir):
    r = cli(
        "-m",
        "target=tiny",
        "stage=prepare",
        "data.limit=2,3",
        f"hydra.sweep.dir={tmp_path}/sweep",
        f"run_dir={tmp_path}/limit" + "${data.limit}",
        cache_dir=cache_dir,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    for n in (2, 3):
        assert json.loads((tmp_path / f"limit{n}" / "prepared" / "stats.json").read_text())["samples"] == n


@pytest.mark.parametrize("tool", ["serve", "verify"])
def test_tools_write_nothing_into_a_run_dir(exported_run, cache_dir, tool):
    """`verify`/`serve` without run_dir= once wrote .hydra/ and a log into the DEFAULT run dir (issue #12,
    B2),
    over a real run's recorded config."""
    run_dir, _ = exported_run
    name = f"probe-tool-{tool}-{os.getpid()}"
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    r = cli(
        f"stage={tool}",
        f"run_name={name}",
        f"export_dir={run_dir}/export/sglang",
        "engine=sglang",
        cache_dir=cache_dir,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (ROOT / "runs" / name).exists() and not (ROOT / ".hydra").exists()
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
