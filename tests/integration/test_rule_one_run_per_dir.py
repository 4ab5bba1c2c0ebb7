"""Issue #35, rule 2: one run at a time per run dir, and a job owns its processes.

A run dir's lock (run_dir/run.lock: the kernel's flock plus the holder's record) refuses a second command in
one line naming the holder (host, pid, command, since); a holder that died left only a record, which the next
command takes over with one warning. The ranks of one job share their rank 0's lock.

The job: a 2-rank CPU training of the tiny target (`accelerate launch --cpu --num_processes 2`, which
eaglepipe relaunches through torch.distributed.run), started in a session of its own as a scheduler starts a
job. While its ranks train, the same training started again in that run dir is refused and check-store (it
only reads) runs beside it. Then the job's process group gets SIGKILL: no rank may outlive it (torchrun starts
each rank in a session of its own, out of the group's reach; each rank now dies with its launcher), and the
same command again takes over the stale lock and resumes. That second job gets SIGTERM at its launcher alone:
its ranks end too."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.errors import UserError
from pipeline.formats import run_lock
from pipeline.runner import run_stages

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
COMMON = ["+experiment=tiny", "data.limit=24"]
# never finishes within the test: each job is stopped mid-way; a checkpoint every 2 steps to resume from
TRAIN = [
    *COMMON,
    "train.device=cpu",
    "train.epochs=1000",
    "train.max_steps=100000",
    "train.save_every_steps=2",
    "train.keep_last=2",
    "train.val_every_steps=100000",
]


def _holder(run_dir: Path) -> subprocess.Popen:
    """Another process holding run_dir's lock, as a running stage holds it."""
    code = (
        "import sys, time\nfrom pipeline.formats import run_lock\n"
        f"lock = run_lock.hold({str(run_dir)!r})\nprint('held', flush=True)\ntime.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_one_run_per_dir_a_second_command_is_refused_naming_the_holder(make_cfg, tmp_path):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(UserError) as e:
            run_stages(make_cfg(*COMMON, "data.limit=4", "stage=prepare", run_dir=tmp_path))
    finally:
        holder.kill()
        holder.wait()
    message = str(e.value)
    assert message.startswith(f"run dir {tmp_path} is in use by pid {holder.pid} on ") and "\n" not in message
    assert "python" in message and "run_lock.hold" in message and "since 20" in message, message
    assert not (tmp_path / "prepared").exists()  # refused before any work


def test_one_run_per_dir_a_dead_holders_lock_is_taken_over_with_one_warning(make_cfg, tmp_path, caplog):
    holder = _holder(tmp_path)
    holder.kill()  # SIGKILL: its record stays, the kernel frees the lock
    holder.wait()
    assert run_lock.read(tmp_path)["pid"] == holder.pid
    run_stages(make_cfg(*COMMON, "data.limit=4", "stage=prepare", run_dir=tmp_path))
    warnings = [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(
        f"run dir {tmp_path}: taking over the stale lock of pid {holder.pid} on {socket.gethostname()} (`"
    ) and warnings[0].endswith("which is gone (killed or crashed before releasing it)"), warnings[0]
    assert (tmp_path / "prepared").is_dir()
    assert run_lock.read(tmp_path) is None  # released: an empty record


def _launch(run_dir: Path, cache_dir: str, log: Path) -> subprocess.Popen:
    accelerate = str(Path(sys.executable).parent / "accelerate")
    cmd = [accelerate, "launch", "--cpu", "--num_processes", "2", "-m", "pipeline", "stage=train", *TRAIN]
    with open(log, "w") as out:
        return subprocess.Popen(
            [*cmd, f"run_dir={run_dir}", f"cache_dir={cache_dir}"],
            cwd=ROOT,
            env=ENV,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own session and process group, as a scheduler starts a job
        )


def _ranks(run_dir: Path) -> list[psutil.Process]:
    """Live processes of eaglepipe ranks in run_dir (RANK set by torchrun)."""
    found = []
    for p in psutil.process_iter():
        try:
            if (
                p.pid != os.getpid()
                and p.status() != psutil.STATUS_ZOMBIE
                and f"run_dir={run_dir}" in p.cmdline()
                and "RANK" in p.environ()
            ):
                found.append(p)
        except psutil.Error:
            continue
    return found


def _until(what, timeout_s: float, job: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = what()
        if value:
            return value
        if job is not None and job.poll() is not None:
            pytest.fail(f"the job ended (exit {job.returncode}): {log.read_text()[-3000:] if log else ''}")
        time.sleep(0.2)
    return None


def _checkpoint_after(run_dir: Path, step: int):
    return lambda: sorted(
        int(p.parent.name.split("_")[1])
        for p in (run_dir / "train").glob("step_*/train_state.json")
        if int(p.parent.name.split("_")[1]) > step
    )


def _gone_within(run_dir: Path, timeout_s: float) -> tuple[float, list[str]]:
    """(seconds until no rank of run_dir ran, or timeout_s; the ranks left then, killed here)."""
    t0 = time.time()
    while time.time() - t0 < timeout_s and _ranks(run_dir):
        time.sleep(0.1)
    seconds, left = time.time() - t0, []
    for p in _ranks(run_dir):  # orphans: named, then stopped so they cannot disturb other tests
        try:
            left.append(f"pid {p.pid} RANK={p.environ().get('RANK')}: {' '.join(p.cmdline())[:200]}")
            p.kill()
        except psutil.Error:
            continue
    return seconds, left


@pytest.fixture(scope="module")
def stopped_jobs(make_cfg, tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("one run per dir") / "run"
    for stage in ("prepare", "extract", "vocab"):
        run_stages(make_cfg(*COMMON, f"stage={stage}", run_dir=run_dir))
    seen = {}
    first = _launch(run_dir, cache_dir, run_dir.parent / "first.log")
    try:
        steps = _until(_checkpoint_after(run_dir, 0), 600, first, run_dir.parent / "first.log")
        assert steps and len(_ranks(run_dir)) == 2
        seen["record"] = run_lock.read(run_dir)
        seen["ranks"] = sorted(int(p.environ()["RANK"]) for p in _ranks(run_dir))
        one = [sys.executable, "-m", "pipeline", f"run_dir={run_dir}", f"cache_dir={cache_dir}"]
        seen["second"] = subprocess.run(
            [*one, "stage=train", *TRAIN], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
        )
        seen["check_store"] = subprocess.run(
            [*one, "stage=check_store"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
        )
        seen["alive_after_second"] = first.poll() is None and len(_ranks(run_dir)) == 2
        if first.poll() is not None:
            log = (run_dir.parent / "first.log").read_text()[-3000:]
            pytest.fail(f"the job ended (exit {first.returncode}) before it was killed: {log}")
        os.killpg(first.pid, signal.SIGKILL)  # the job's process group, as a scheduler cancels a job
        first.wait()
        seen["kill"] = _gone_within(run_dir, 15)
        killed_at = max(_checkpoint_after(run_dir, 0)())  # once no rank writes any more

        rerun_log = run_dir.parent / "rerun.log"
        rerun = _launch(run_dir, cache_dir, rerun_log)
        seen["rerun_steps"] = _until(
            lambda: "resumed from" in rerun_log.read_text() and _checkpoint_after(run_dir, killed_at)(),
            600,
            rerun,
            rerun_log,
        )
        seen["rerun_ranks"] = len(_ranks(run_dir))
        rerun.send_signal(signal.SIGTERM)  # the launcher alone
        rerun.wait(timeout=60)
        seen["term"] = _gone_within(run_dir, 15)
        seen["rerun_log"] = rerun_log.read_text()
    finally:
        for job in (first, locals().get("rerun")):
            if job is not None and job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
        _gone_within(run_dir, 5)
    seen["run_dir"] = run_dir
    return seen


def test_one_run_per_dir_the_ranks_of_one_job_share_its_lock(stopped_jobs):
    record = stopped_jobs["record"]
    assert stopped_jobs["ranks"] == [0, 1]
    assert record and record["job"] and "stage=train" in record["command"]


def test_one_run_per_dir_a_second_training_beside_a_running_job_is_refused(stopped_jobs):
    second, record = stopped_jobs["second"], stopped_jobs["record"]
    assert second.returncode == 2, second.stderr[-3000:]
    line = second.stderr.strip().splitlines()[-1]
    assert line.startswith(
        f"eaglepipe: error: run dir {stopped_jobs['run_dir']} is in use by pid {record['pid']} on "
        f"{record['host']} (`"
    ), line
    assert "stage=train" in line and f"since {record['since']}" in line, line
    assert stopped_jobs["alive_after_second"]  # the refused command disturbed nothing


def test_one_run_per_dir_tools_that_only_read_run_beside_a_job(stopped_jobs):
    r = stopped_jobs["check_store"]
    assert r.returncode == 0 and "every chunk passes" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_one_run_per_dir_killing_the_jobs_process_group_ends_every_rank(stopped_jobs):
    seconds, left = stopped_jobs["kill"]
    assert left == [] and seconds < 10, left


def test_one_run_per_dir_a_rerun_takes_over_the_stale_lock_and_resumes(stopped_jobs):
    log = stopped_jobs["rerun_log"]
    assert "taking over the stale lock of pid" in log and "which is gone" in log, log[-3000:]
    assert "train: resumed from" in log, log[-3000:]
    assert stopped_jobs["rerun_steps"] and stopped_jobs["rerun_ranks"] == 2


def test_one_run_per_dir_sigterm_to_the_launcher_ends_every_rank(stopped_jobs):
    seconds, left = stopped_jobs["term"]
    assert stopped_jobs["rerun_ranks"] == 2  # both trained when the launcher got SIGTERM
    assert left == [] and seconds < 10, left
