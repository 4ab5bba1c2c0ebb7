"""eaglepipe on a real SLURM (issue #38): the local one-node cluster of tests/slurm_local.sh
(tests/slurm_local.py brings it up, or uses one that is up, and takes it down at the end). No mocks: sbatch,
srun, submitit's SLURM executor, scancel's signals and scontrol requeue act on real jobs.

One store (tiny); each run trains 8 steps of 2 packs on its own run dir with that store copied in:
  R: torchrun, 2 ranks (the reference)
  S: an sbatch job of 2 tasks, `srun --ntasks=2 python -m pipeline stage=train`: 2 ranks from SLURM's
     variables
  L: `eaglepipe -m hydra/launcher=slurm hydra.launcher.tasks_per_node=2`: submitit's job of 2 tasks, 2 ranks
All three end at the same weights."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import slurm_local
import torch
from safetensors.torch import load_file

from pipeline.runner import run_stages

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
COMMON = [
    "+experiment=tiny",
    "data.limit=40",
    "train.max_steps=8",
    "train.save_every_steps=2",
    "train.keep_last=10",
    "train.val_every_steps=1000",
    "train.device=cpu",
]
LAUNCHER = [  # the slurm launcher's GPU-node defaults cut to the local node (2 CPUs, no GPU)
    "hydra/launcher=slurm",
    "hydra.launcher.partition=debug",
    "hydra.launcher.tasks_per_node=2",
    "hydra.launcher.gpus_per_node=0",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=1",
]


@pytest.fixture(scope="module")
def cluster():
    c = slurm_local.Cluster()
    yield c
    c.close()


@pytest.fixture(scope="module")
def store(make_cfg, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("slurm") / "store"
    for stage in ("prepare", "extract", "vocab"):
        run_stages(make_cfg(*COMMON, f"stage={stage}", run_dir=root))
    return root


def _copy_inputs(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in ("prepared", "features", "vocab", "stages.json"):
        (shutil.copytree if (src / name).is_dir() else shutil.copy)(src / name, dst / name)
    return dst


def _final(run_dir: Path) -> dict:
    return load_file(str(run_dir / "train" / "final" / "model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "train" / "final" / "train_summary.json").read_text())


@pytest.fixture(scope="module")
def reference(store, cache_dir) -> Path:
    """R: the same training under torchrun, 2 ranks."""
    run_dir = _copy_inputs(store, store.parent / "R")
    r = slurm_local.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "pipeline",
        ]
        + [*COMMON, "stage=train", f"run_dir={run_dir}", f"cache_dir={cache_dir}"]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def test_srun_in_an_sbatch_job_trains_on_two_ranks_as_torchrun_does(cluster, store, reference, cache_dir):
    run_dir = _copy_inputs(store, store.parent / "S")
    out = store.parent / "S.out"
    script = store.parent / "S.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"cd {ROOT}\n"
        f"srun --ntasks=2 {sys.executable} -m pipeline stage=train {' '.join(COMMON)} run_dir={run_dir} "
        f"cache_dir={cache_dir}\n"
    )
    r = slurm_local.run(["sbatch", "--parsable", "--wait", "--ntasks=2", f"--output={out}", str(script)])
    job = r.stdout.strip().split(";")[0]
    log = out.read_text() if out.exists() else ""
    assert r.returncode == 0, f"job {job}: {r.stderr}\n{log[-3000:]}"
    assert slurm_local.job_fields(job)["JobState"] == "COMPLETED"
    assert f"ranks: 2 from slurm (SLURM job {job}): 1 node(s) x 2 rank(s); rendezvous" in log, log[-3000:]
    summary = _summary(run_dir)
    assert summary["world_size"] == 2 and summary["optimizer_steps"] == 8
    assert summary["rank_layout"] == {
        "launcher": "slurm",
        "nodes": 1,
        "ranks_per_node": 2,
        "rendezvous": f"{slurm_local.job_host()}:{10000 + int(job) % 20000}",
        "slurm_job_id": job,
    }
    assert _summary(reference)["rank_layout"]["launcher"] == "torchrun"
    assert _same(_final(run_dir), _final(reference))


def test_the_slurm_launcher_with_two_tasks_per_node_trains_on_two_ranks(cluster, store, reference, cache_dir):
    base = store.parent / "L"
    _copy_inputs(store, base / "0")  # the multirun's job 0 works in ${run_dir}/0
    eaglepipe = str(Path(sys.executable).parent / "eaglepipe")
    r = slurm_local.run(
        [eaglepipe, "-m", *LAUNCHER, "stage=train", *COMMON, f"run_dir={base}", f"cache_dir={cache_dir}"]
    )
    logs = "".join(p.read_text() for p in sorted((base / ".submitit").rglob("*_log.*")))
    assert r.returncode == 0, r.stderr[-3000:] + logs[-3000:]
    job = next((base / ".submitit").iterdir()).name
    assert f"ranks: 2 from slurm (SLURM job {job})" in logs, logs[-3000:]
    summary = _summary(base / "0")
    assert summary["world_size"] == 2 and summary["rank_layout"]["launcher"] == "slurm"
    assert _same(_final(base / "0"), _final(reference))


def test_the_local_cluster_script_is_idempotent_and_reports_its_state(cluster):
    again = subprocess.run(
        [str(slurm_local.SCRIPT), "up"], capture_output=True, text=True, env=slurm_local.env(), timeout=120
    )
    assert again.returncode == 0 and "up already" in again.stderr, again.stderr
    status = subprocess.run(
        [str(slurm_local.SCRIPT), "status"], capture_output=True, text=True, env=slurm_local.env(), timeout=60
    )
    # idle, or busy with a job another test left finishing
    node = rf"{slurm_local.job_host()} (idle|mixed|allocated|completing) "
    assert status.returncode == 0 and re.search(node, status.stdout), status.stdout
    for daemon in ("munged", "slurmctld", "slurmd"):
        assert f"{daemon}: running (pid " in status.stdout


SUBMIT = [  # the chain's jobs cut to the local node: 2 ranks for extract and train, 1 CPU each
    "submit.ranks=2",
    "submit.gpus_per_rank=0",
    "submit.cpus_per_rank=1",
    "submit.mem_gb_per_rank=1",
    "submit.poll_s=1",
    "eval.device=cpu",
    "extract.device=cpu",
]


def test_submit_runs_the_chain_as_jobs_and_a_second_submit_submits_nothing(cluster, tmp_path, cache_dir):
    eaglepipe = str(Path(sys.executable).parent / "eaglepipe")
    run_dir = tmp_path / "chain"
    cmd = [eaglepipe, "submit", *COMMON, *SUBMIT, f"run_dir={run_dir}", f"cache_dir={cache_dir}"]
    r = slurm_local.run([*cmd, "submit.wait=true"], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = json.loads((run_dir / "cluster" / "jobs.json").read_text())["stages"]
    order = ["prepare", "extract", "vocab", "train", "export", "evaluate"]
    assert sorted(jobs) == sorted(order)
    for stage, entry in jobs.items():
        assert f"submit: {stage:<8} job {entry['job_id']} submitted" in r.stderr
        assert slurm_local.job_fields(entry["job_id"])["JobState"] == "COMPLETED"
    assert [jobs[s]["ranks"] for s in order] == [1, 2, 1, 2, 1, 1]
    assert [jobs[s]["after"] for s in order] == [None] + [jobs[s]["job_id"] for s in order[:-1]]
    assert jobs["extract"]["after"] == jobs["prepare"]["job_id"]  # chained by afterok
    assert slurm_local.job_fields(jobs["extract"]["job_id"])["Dependency"] in ("(null)", "")
    summary = _summary(run_dir)
    assert summary["world_size"] == 2 and summary["rank_layout"]["launcher"] == "slurm"
    assert (run_dir / "eval").is_dir()
    again = slurm_local.run(cmd, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "every stage is up to date; nothing submitted" in again.stderr
    assert "submitted" not in again.stderr.replace("nothing submitted", "")


@pytest.mark.parametrize(
    "override, line",
    [
        ("submit.partition=gpu", "partition gpu does not exist (sinfo lists: debug): set submit.partition"),
        ("submit.cpus_per_rank=64", "extract asks for 128 CPUs, 0 GPUs, 2 GB on one node"),
    ],
)
def test_submit_refuses_what_the_cluster_cannot_run_in_one_line_submitting_nothing(
    cluster, tmp_path, override, line
):
    eaglepipe = str(Path(sys.executable).parent / "eaglepipe")
    run_dir = tmp_path / "bad"
    r = slurm_local.run([eaglepipe, "submit", *COMMON, *SUBMIT, override, f"run_dir={run_dir}"])
    assert r.returncode == 2 and line in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (run_dir / "cluster" / "jobs.json").exists()


def test_submit_without_slurm_says_what_is_missing(tmp_path):
    eaglepipe = str(Path(sys.executable).parent / "eaglepipe")
    env = {**slurm_local.env(), "PATH": str(Path(sys.executable).parent)}  # no sbatch, no sinfo on PATH
    r = subprocess.run(
        [eaglepipe, "submit", *COMMON, *SUBMIT, f"run_dir={tmp_path / 'x'}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 2 and "sinfo not found: SLURM's client commands are not installed" in r.stderr
