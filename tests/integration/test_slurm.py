"""eaglepipe on a real SLURM (issue #38): the local one-node cluster of tests/slurm_local.sh
(tests/slurm_local.py brings it up, or uses one that is up, and takes it down at the end). No mocks: sbatch,
srun, submitit's SLURM executor, scancel's signals and scontrol requeue act on real jobs.

Each run trains 20 steps of 2 packs, checkpointing every 4, on the same inputs (prepare, extract and vocab of
the tiny target, built once in this process; the stages' own runs under SLURM ranks are other files' tests):
  C: `eaglepipe submit` on those inputs: train, export and evaluate as batch jobs (the copied stages are up to
     date); its train job (srun, 2 tasks) gets SLURM's warning signal mid-run (checkpoint, requeue itself),
     then is held at a hard requeue, given one task instead of two and released (it resumes on one rank); the
     second submit follows the jobs it keeps, the third submits nothing
  L: `eaglepipe -m hydra/launcher=slurm hydra.launcher.tasks_per_node=2` over two sweep points on copies of
     the inputs: submitit's jobs of 2 tasks each, 2 ranks from SLURM's variables, each point in its own run
     dir, never interrupted
  F: the whole chain submitted (six jobs, afterok), its prepare job failing
C's checkpoint written after the signalled requeue (2 ranks) and both points of L hold the same weights (the
interrupted run's at the uninterrupted one's). Every SLURM job pays a process start (torch, Hydra, the
pipeline) of seconds on this 2-core machine, so the runs share their inputs and each behaviour takes the jobs
it needs (#48: the elastic resume on one task was a run of its own, E). L, F and a submit to a partition that
does not exist start with C (the local node declares 4 CPUs per core: tests/slurm_local.py says why)"""

import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import slurm_local
import torch
from safetensors.torch import load_file

from pipeline.cluster import chain, slurm
from pipeline.errors import UserError
from pipeline.formats import cluster_jobs, train_summary
from pipeline.runner import read_records, run_stages, write_record

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
EAGLEPIPE = str(Path(sys.executable).parent / "eaglepipe")
COMMON = [
    "+experiment=tiny",
    "data.limit=16",
    "train.max_steps=20",
    "train.save_every_steps=4",
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


SUBMIT = [  # the chain's jobs cut to the local node: 2 ranks for extract and train, 1 CPU each
    "submit.ranks=2",
    "submit.gpus_per_rank=0",
    "submit.cpus_per_rank=1",
    "submit.mem_gb_per_rank=1",
    "submit.poll_s=1",
    "eval.device=cpu",
    "extract.device=cpu",
    "export.engines=[sglang]",  # one engine's check: the export stage is the chain's longest job here
]
# The side runs (L, E and F, a chain that fails) yield the cores to C, whose jobs are the critical path:
# the local cluster propagates a job's nice value to its tasks (PropagatePrioProcess=1)
NICE = ["nice", "-n", "10"]
INPUTS = ("prepare", "extract", "vocab")  # the stages whose outputs every run here shares


def _copy_inputs(src: Path, dst: Path) -> Path:
    """prepared/, features/, vocab/ and their records: a run dir whose first stale stage is train."""
    dst.mkdir(parents=True)
    for name in ("prepared", "features", "vocab"):
        shutil.copytree(src / name, dst / name)
    records = read_records(src)
    for stage in INPUTS:
        write_record(dst, stage, records[stage])
    return dst


def _final(run_dir: Path) -> dict:
    return load_file(str(run_dir / "train" / "final" / "model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _summary(run_dir: Path) -> dict:
    return train_summary.read(run_dir / "train" / "final")


def _wait(what: str, until, timeout: float = 240):
    """Poll until `until()` gives a truthy value (0.2 s apart); the value."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := until():
            return value
        time.sleep(0.2)  # a `scontrol show job` costs ~6 ms of CPU: the waits cost the jobs a few %
    raise AssertionError(f"waited {timeout} s for {what}")


def _running_again(job: str, restarts: str) -> bool:
    """A requeued job waits out SLURM's own delay (AuthInfo=cred_expire + 1 s: 6 s on the local cluster) and
    runs again; never started sooner (a restart in the second its previous run was killed is refused)."""
    f = slurm_local.job_fields(job)
    if f["JobState"] in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
        out = Path(f.get("StdOut") or "/nonexistent")  # a job refused at launch may have written no log
        log = out.read_text(errors="replace")[-3000:] if out.is_file() else f"(no log at {out})"
        raise AssertionError(f"job {job} {f['JobState']} after {f.get('Restarts')} requeue(s): {f}\n{log}")
    return f.get("Restarts") == restarts and f["JobState"] == "RUNNING"


def _checkpoints(run_dir: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (run_dir / "train").glob("step_[0-9]*") if p.name[5:].isdigit())


def _start_sweep(src: Path, base: Path, cache_dir: str) -> subprocess.Popen:
    """L, in the background: two sweep points on the slurm launcher, 2 tasks each, on copies of C's inputs."""
    for n in ("0", "1"):  # the multirun's job N works in ${run_dir}/N
        _copy_inputs(src, base / n)
    cmd = [*NICE, EAGLEPIPE, "-m", *LAUNCHER, "stage=train", *COMMON, "train.log_every_steps=5,10"]
    cmd += [f"run_dir={base}", f"cache_dir={cache_dir}"]
    with (base / "sweep.out").open("w") as out:  # the child keeps its own copy of the descriptor
        env = slurm_local.env()
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, text=True)


def _failing(base: Path, cache_dir: str) -> dict:
    """F: a chain whose prepare job fails (its data passes the checks, the file exists, but holds nothing)."""
    data = base / "empty.jsonl"
    data.write_text('{"messages": []}\n')
    run_dir = base / "F"
    r = slurm_local.run(
        [
            *NICE,
            EAGLEPIPE,
            "submit",
            *COMMON,
            *SUBMIT,
            "data=messages",
            f"data.path={data}",
            "submit.wait=true",
        ]
        + [f"run_dir={run_dir}", f"cache_dir={cache_dir}"]
    )
    return {"submit": r, "jobs": cluster_jobs.read(run_dir)}


def _refused(run_dir: Path, cache_dir: str) -> tuple[subprocess.CompletedProcess, Path]:
    """A submit to a partition the cluster does not have (run beside C: a process start of seconds)."""
    cmd = [*NICE, EAGLEPIPE, "submit", *COMMON, *SUBMIT, "submit.partition=gpu", f"run_dir={run_dir}"]
    return slurm_local.run([*cmd, f"cache_dir={cache_dir}"]), run_dir


@pytest.fixture(scope="module")
def submitted(cluster, make_cfg, tmp_path_factory, cache_dir):
    """C: the chain submitted on built inputs; its train job signalled, then held at a hard requeue, given
    one task and released; followed; submitted again. L, F and the refused submit start with it (F and the
    refused submit driven from threads)."""
    base = tmp_path_factory.mktemp("slurm")
    inputs = base / "inputs"
    for stage in INPUTS:
        run_stages(make_cfg(*COMMON, *SUBMIT, f"stage={stage}", run_dir=inputs))
    run_dir = _copy_inputs(inputs, base / "C")
    cmd = [EAGLEPIPE, "submit", *COMMON, *SUBMIT, f"run_dir={run_dir}", f"cache_dir={cache_dir}"]
    r = slurm_local.run(cmd)
    first = r.stdout + r.stderr  # a tool's log goes to stdout
    assert r.returncode == 0, first[-3000:]
    jobs = cluster_jobs.read(run_dir)
    pool = ThreadPoolExecutor(2)
    failing = pool.submit(_failing, base, cache_dir)
    refused = pool.submit(_refused, base / "bad", cache_dir)
    sweep = _start_sweep(inputs, base / "L", cache_dir)
    try:
        train = jobs["train"]["job_id"]  # SLURM's warning signal mid-run, as --signal=B:USR2@N sends it
        _wait("train's first checkpoint", lambda: _checkpoints(run_dir))
        slurm_local.run(["scancel", "--batch", "--signal=USR2", train])
        _wait("the signalled job to be requeued and run again", lambda: _running_again(train, "1"))
        signalled = _checkpoints(run_dir)[-1]  # written on the signal; the requeued job resumes from it
        after = _wait("a newer checkpoint", lambda: [c for c in _checkpoints(run_dir) if c > signalled])[0]
        # a hard requeue, no warning, held: the job comes back with one task instead of two
        slurm_local.run(["scontrol", "requeuehold", train])
        _wait("the job held", lambda: slurm_local.job_fields(train)["JobState"] == "PENDING")
        update = slurm_local.run(["scontrol", "update", f"JobId={train}", "NumTasks=1", "NumCPUs=1"])
        assert update.returncode == 0, update.stderr
        slurm_local.run(["scontrol", "release", train])
        _wait("the job to run again with one task", lambda: _running_again(train, "2"))

        follow = slurm_local.run([*cmd, "submit.wait=true"], timeout=600)  # keeps the jobs, follows them
        assert follow.returncode == 0, (follow.stdout + follow.stderr)[-3000:]
        again = slurm_local.run(cmd)
        yield {
            "run_dir": run_dir,
            "jobs": jobs,
            "first": first,
            "signalled": signalled,
            "after_signal": after,
            "follow": follow.stdout + follow.stderr,
            "again": again,
            "sweep": sweep,
            "failing": failing,
            "refused": refused,
        }
    finally:
        if sweep.poll() is None:  # a failure above: nothing of this module keeps running
            sweep.kill()
        pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def sweep(submitted) -> dict:
    base = submitted["run_dir"].parent / "L"
    rc = submitted["sweep"].wait(timeout=600)
    logs = "".join(p.read_text() for p in sorted((base / ".submitit").rglob("*_log.*")))
    assert rc == 0, (base / "sweep.out").read_text()[-3000:] + logs[-3000:]
    return {"base": base, "logs": logs}


def test_a_sweep_on_the_slurm_launcher_trains_each_point_on_two_ranks_in_its_own_dir(sweep):
    base, logs = sweep["base"], sweep["logs"]
    # an array job's tasks (ARRAY_TASK), beside its submission folder and submitit's own links
    jobs = sorted(p.name for p in (base / ".submitit").iterdir() if p.is_dir() and "_" in p.name)
    assert len(jobs) == 2, jobs
    # submitit has both results; SLURM ends the tasks' steps a moment later
    _wait(
        "both tasks COMPLETED",
        lambda: all(slurm_local.job_fields(j)["JobState"] == "COMPLETED" for j in jobs),
        60,
    )
    assert logs.count("ranks: 2 from slurm (SLURM job ") >= 2, logs[-3000:]  # each job's layout, logged
    for n in ("0", "1"):
        summary = _summary(base / n)
        assert summary["world_size"] == 2 and summary["rank_layout"]["launcher"] == "slurm"
    assert _same(_final(base / "0"), _final(base / "1"))  # the points differ only in their log interval


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


def test_submit_runs_the_stages_left_as_jobs_requeued_onto_one_task_and_a_second_submit_submits_nothing(
    submitted, sweep
):
    run_dir, jobs, out = submitted["run_dir"], submitted["jobs"], submitted["first"]
    order = ["train", "export", "evaluate"]  # prepare, extract and vocab copied in: up to date, not submitted
    assert sorted(jobs) == sorted(order)
    for stage in order:
        assert f"submit: {stage:<8} job {jobs[stage]['job_id']} submitted" in out, out
    assert [jobs[s]["ranks"] for s in order] == [2, 1, 1]
    assert [jobs[s]["after"] for s in order] == [None] + [jobs[s]["job_id"] for s in order[:-1]]  # afterok

    train, out = jobs["train"]["job_id"], submitted["follow"]
    # the follower keeps the jobs still queued or running (train may have finished on its one rank already)
    assert re.search(rf"submit: train    (job {train} kept|up to date)", out), out
    assert f"submit: evaluate job {jobs['evaluate']['job_id']} kept" in out, out
    assert re.search(r"the chain finished \([23] job\(s\)\)", out), out
    assert all(slurm_local.job_fields(jobs[s]["job_id"])["JobState"] == "COMPLETED" for s in order)
    fields = slurm_local.job_fields(train)
    assert fields["Restarts"] == "2" and fields["NumTasks"] == "1", fields
    log = Path(jobs["train"]["log"]).read_text(errors="replace")  # a killed task may cut a character
    resumed = sorted(
        {int(n) for n in re.findall(r"train: resumed from \S+/step_(\d+) ", log)}
    )  # every rank logs
    assert f"requeueing SLURM job {train}" in log, log[-3000:]
    assert len(resumed) == 2 and resumed[0] == submitted["signalled"], log[-3000:]
    layout = (
        f"ranks: 2 from slurm (SLURM job {train}): 1 node(s) x 2 rank(s); rendezvous {slurm_local.job_host()}"
    )
    assert f"{layout}:{10000 + int(train) % 20000}" in log, log[-3000:]  # before the hold: 2 tasks, own port
    one = r"train: resumed from \S+step_0000\d\d \(step \d+, .*\), on 1 rank\(s\)"
    assert re.search(one, log), log[-3000:]  # after it: the packs left, on one rank
    summary, reference = _summary(run_dir), sweep["base"] / "0"
    assert summary["world_size"] == 1, summary  # a job of one task: one process, no rendezvous
    assert summary["optimizer_steps"] > _summary(reference)["optimizer_steps"], summary  # 1 pack a step now
    step = f"step_{submitted['after_signal']:06d}"  # written on 2 ranks after the signalled requeue
    after = load_file(str(run_dir / "train" / step / "model.safetensors"))
    assert _same(after, load_file(str(reference / "train" / step / "model.safetensors")))  # uninterrupted's

    again = submitted["again"]
    out = again.stdout + again.stderr
    assert again.returncode == 0 and "every stage is up to date; nothing submitted" in out, out[-3000:]
    assert "submitted" not in out.replace("nothing submitted", "")


def test_a_job_that_fails_mid_chain_names_its_log_and_its_dependents_are_cancelled(submitted):
    failing = submitted["failing"].result(timeout=600)
    r, jobs = failing["submit"], failing["jobs"]
    order = ["prepare", "extract", "vocab", "train", "export", "evaluate"]  # the whole chain, afterok
    assert sorted(jobs) == sorted(order)
    for stage in order:
        assert f"submit: {stage:<8} job {jobs[stage]['job_id']} submitted" in r.stdout + r.stderr
    assert [jobs[s]["ranks"] for s in order] == [1, 2, 1, 2, 1, 1]
    assert [jobs[s]["after"] for s in order] == [None] + [jobs[s]["job_id"] for s in order[:-1]]
    prepare = jobs["prepare"]["job_id"]
    rest = [jobs[s]["job_id"] for s in ("extract", "vocab", "train", "export", "evaluate")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert (
        f"stage prepare: job {prepare} FAILED (exit 2:0); its log: {jobs['prepare']['log']}; "
        f"5 job(s) after it cancelled ({', '.join(rest)})" in r.stderr
    )
    assert "no usable conversation" in Path(jobs["prepare"]["log"]).read_text(errors="replace")
    assert {slurm_local.job_fields(j)["JobState"] for j in rest} == {"CANCELLED"}


def test_submit_refuses_a_partition_that_does_not_exist_in_one_line_submitting_nothing(submitted):
    r, run_dir = submitted["refused"].result(timeout=300)
    line = "partition gpu does not exist (sinfo lists: debug): set submit.partition"
    assert r.returncode == 2 and line in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not cluster_jobs.path(run_dir).exists()


def test_a_request_larger_than_any_node_is_refused_before_anything_is_submitted(
    cluster, make_cfg, monkeypatch
):
    monkeypatch.setenv("SLURM_CONF", str(slurm_local.CONF))
    cfg = make_cfg(*COMMON, *SUBMIT, "submit.cpus_per_rank=64")
    line = (
        r"prepare asks for 64 CPUs.*; extract asks for 128 CPUs, 0 GPUs, 2 GB on one node: the largest node"
    )
    with pytest.raises(UserError, match=line):
        chain.check_fits(cfg, ["prepare", "extract"], ("extract", "train"))


def test_slurm_commands_missing_or_the_controller_down_are_one_line(cluster, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sinfo here
    with pytest.raises(UserError, match="sinfo not found: SLURM's client commands are not installed"):
        slurm.nodes(None)
    monkeypatch.undo()
    conf = tmp_path / "slurm.conf"  # a controller nobody runs
    conf.write_text(
        slurm_local.CONF.read_text().replace("SlurmctldPort=", "SlurmctldPort=1") + "MessageTimeout=1\n"
    )
    monkeypatch.setenv("SLURM_CONF", str(conf))
    with pytest.raises(UserError, match="slurmctld does not answer"):
        slurm.nodes(None)
