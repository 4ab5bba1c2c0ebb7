"""Cluster jobs through Hydra's submitit launcher (issue #15 item 5), run here with submitit's LocalExecutor
(`hydra/launcher=submitit_local`: the code path of `hydra/launcher=slurm` on one machine, its requeue
included).

One 2-job sweep (`--multirun train.log_every_steps=1,2`, which changes what is logged, not the weights): each
job trains in its own run dir (${run_dir}/N). Job 0 gets SLURM's warning signal (SIGUSR2) mid-run, as SLURM
sends it before a time limit or a preemption: it writes a checkpoint at the next optimizer step, submitit
requeues it, and
the requeued job resumes from that checkpoint. Its final weights equal job 1's, which ran uninterrupted."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from pipeline.runner import run_stages

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
COMMON = [
    "+experiment=tiny",
    "data.limit=40",
    "train.max_steps=30",
    "train.save_every_steps=1000",
    "train.val_every_steps=1000",
    "train.device=cpu",
]


def _task_pid(launcher: subprocess.Popen, job_dir: Path) -> int | None:
    """The submitit task process (`python -m submitit.core._submit`) that writes job_dir's log."""
    for proc in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if "submitit.core._submit" in " ".join(proc.cmdline()) and any(
                Path(f.path).parent == job_dir for f in proc.open_files()
            ):
                return proc.pid
        except psutil.Error:
            continue
    return None


def _train_steps(job_dir: Path) -> list[int]:
    path = job_dir / "train" / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if r.get("split") == "train"]


@pytest.fixture(scope="module")
def sweep(make_cfg, tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("launcher")
    store = root / "store"
    for stage in ("prepare", "extract", "vocab"):
        run_stages(make_cfg(*COMMON, f"stage={stage}", run_dir=store))
    base = root / "sweep"
    for n in ("0", "1"):  # the jobs' run dirs (${run_dir}/N) start with the same inputs
        for part in ("prepared", "features", "vocab"):
            shutil.copytree(store / part, base / n / part)
    eaglepipe = str(Path(sys.executable).parent / "eaglepipe")  # the console script users type
    cmd = [
        eaglepipe,
        "-m",
        "hydra/launcher=submitit_local",
        "stage=train",
        *COMMON,
        "train.log_every_steps=1,2",
        f"run_dir={base}",
        f"cache_dir={cache_dir}",
    ]
    launcher = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    signalled, deadline = None, time.time() + 300
    while signalled is None and time.time() < deadline and launcher.poll() is None:
        steps = _train_steps(base / "0")
        if steps and 3 <= steps[-1] < 20:
            pid = _task_pid(launcher, base / "0")
            if pid:
                os.kill(pid, signal.SIGUSR2)
                signalled = steps[-1]
        time.sleep(0.02)
    out, err = launcher.communicate(timeout=600)
    assert signalled is not None, f"job 0 was not signalled mid-run: {err[-3000:]}"
    logs = "".join(p.read_text() for p in (base / ".submitit").rglob("*_log.*"))
    return {
        "base": base,
        "rc": launcher.returncode,
        "stderr": err,
        "logs": logs,
        "signalled_after": signalled,
    }


def test_a_two_job_sweep_runs_each_job_in_its_own_run_dir(sweep):
    assert sweep["rc"] == 0, sweep["stderr"][-3000:]
    for n, every in (("0", 1), ("1", 2)):
        job = sweep["base"] / n
        summary = json.loads((job / "train" / "final" / "train_summary.json").read_text())
        assert summary["config"]["train"]["log_every_steps"] == every
        assert summary["config"]["run_dir"] == str(job)
        assert summary["optimizer_steps"] == 30
        assert "train.log_every_steps=" in (job / ".hydra" / "overrides.yaml").read_text()
    assert _train_steps(sweep["base"] / "1") == list(range(2, 31, 2))


def test_the_signalled_job_checkpoints_is_requeued_and_ends_at_the_uninterrupted_weights(sweep):
    logs = sweep["logs"]
    assert "preemption signal: checkpoint at step" in logs, logs[-3000:]
    step = int(logs.split("preemption signal: checkpoint at step ")[1].split(" ")[0])
    assert step >= sweep["signalled_after"]  # at the next optimizer step after the signal, not a periodic one
    assert "Requeued job" in logs
    assert f"train: resumed from {sweep['base'] / '0' / 'train' / f'step_{step:06d}'} (step {step}" in logs
    a = load_file(str(sweep["base"] / "0" / "train" / "final" / "model.safetensors"))
    b = load_file(str(sweep["base"] / "1" / "train" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
