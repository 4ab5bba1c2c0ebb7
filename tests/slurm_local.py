"""The local SLURM cluster for the tests marked `slurm` (issue #38): `tests/slurm_local.sh` brings it up
(installing Debian's packages when missing, as root) unless one is up already, and takes it down once the
last test session using it ends; a cluster that was up before the tests is left up.

Several pytest workers (or sessions) may use it at once: each holds a shared flock on
`$EAGLEPIPE_SLURM_DIR/users.lock` while it runs; the one that can then take it exclusively is the last one
and takes the cluster down, if a test session brought it up (`up_by_tests` names that)."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "slurm_local.sh"
DIR = Path(os.environ.get("EAGLEPIPE_SLURM_DIR", "/tmp/eaglepipe-slurm"))
CONF = DIR / "slurm.conf"


def env(**extra: str) -> dict:
    """The environment for sbatch/srun/scontrol against the local cluster (and the jobs it submits)."""
    return {**os.environ, "SLURM_CONF": str(CONF), "OMP_NUM_THREADS": "1", **extra}


# The node as the tests bring it up: 4 CPUs per core. Their jobs spend most of their time starting Python and
# in SLURM's own delays; with the cores' count alone a sweep, an elastic run and the chain queue one behind
# the other on 2 cores, half of them idle (measured: 35 % idle over the file's 313 s).
CPUS = str(4 * (os.cpu_count() or 1))


def _script(action: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SCRIPT), action], capture_output=True, text=True, timeout=600, env=env(EAGLEPIPE_SLURM_CPUS=CPUS)
    )


class Cluster:
    def __init__(self):
        DIR.mkdir(parents=True, exist_ok=True)
        self.users = os.open(DIR / "users.lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.users, fcntl.LOCK_SH)
        marker = DIR / "up_by_tests"
        if _script("status").returncode != 0:
            r = _script("up")
            if r.returncode != 0:
                raise RuntimeError(f"tests/slurm_local.sh up failed:\n{r.stdout}\n{r.stderr}")
            marker.touch()

    def close(self) -> None:
        try:
            fcntl.flock(self.users, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no other session uses it now
            last = True
        except BlockingIOError:
            last = False
        try:
            marker = DIR / "up_by_tests"
            if last and marker.exists():
                _script("down")
                marker.unlink(missing_ok=True)
        finally:
            os.close(self.users)


def job_host() -> str:
    """The local node's name, as slurm.conf names it (`hostname -s`)."""
    return socket.gethostname().split(".")[0]


def run(cmd: list[str], timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(), cwd=ROOT, **kw)


def job_fields(job_id: str) -> dict:
    """`scontrol show job`'s key=value fields (JobState, Restarts, ExitCode, ...)."""
    out = run(["scontrol", "-o", "show", "job", job_id]).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)
