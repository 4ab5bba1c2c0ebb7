"""run_dir/run.lock: one run at a time per run dir (issue #35, rule 2).

The lock is the kernel's: `fcntl.flock` on this file, held for the whole command and released by the kernel
when its holder dies, however it dies (SIGKILL included). The file's body is the holder's record, one JSON
object: host, pid, pid_start (the process's start time, so a reused pid is not taken for the holder), command,
since, job (the multi-rank job it holds the lock for: torchrun's run id and rendezvous address; null for one
process). An empty file is a free lock: a holder that ends empties it.

    with run_lock.hold(run_dir, job) as lock:   # refused in one line naming the holder if another runs here
        lock.took_over                          # the warning line when a dead holder's record was replaced
    run_lock.wait_for_job(run_dir, job)         # ranks > 0: until rank 0 of their own job holds it

A record left by a holder that died without emptying it (the kernel's lock is free) is taken over, with one
warning naming it. On a file system without flock (Lustre mounted `noflock`) the record alone decides: a
holder alive on this host refuses, a dead one is taken over, one on another host refuses with the file to
empty by hand.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path

from pipeline.errors import UserError

FILE = "run.lock"
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # a file system without flock
WAIT_S = 300  # how long ranks > 0 wait for rank 0 of their job to take the lock


def path(run_dir: Path) -> Path:
    return Path(run_dir) / FILE


def read(run_dir: Path) -> dict | None:
    """The holder's record; None: free (empty), or a record not fully written yet."""
    try:
        record = json.loads(path(run_dir).read_text() or "null")
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def describe(record: dict | None) -> str:
    """`pid 123 on host (`command`, since 2026-...)`: who holds (or held) the lock."""
    if not record:
        return "another process (its record is not written yet)"
    command = " ".join(str(record.get("command") or "?").split())  # one line, whatever the arguments hold
    command = command if len(command) <= 240 else command[:237] + "..."
    return f"pid {record.get('pid')} on {record.get('host')} (`{command}`, since {record.get('since')})"


def alive(record: dict) -> bool | None:
    """Whether the recorded holder still runs; None: it ran on another host, which this one cannot see."""
    if record.get("host") != socket.gethostname():
        return None
    start = _start_time(record.get("pid"))
    return start is not None and start == record.get("pid_start", start)


class Lock:
    """A held run-dir lock: the with-block's end (or `release`) empties the record and frees it."""

    def __init__(self, fd: int, flocked: bool, took_over: str | None):
        self.fd, self.flocked, self.took_over = fd, flocked, took_over

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
            if self.flocked:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def hold(run_dir: Path, job: str | None = None) -> Lock:
    """Take run_dir's lock for this process (and the ranks of `job`, if one); another holder: one line."""
    file = path(run_dir)
    try:
        fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(
            f"cannot open the run dir's lock {file} ({e.strerror}): the run dir must be writable"
        ) from None
    try:
        flocked = _flock(fd, run_dir)
        old = read(run_dir)
        if old and not flocked and alive(old) is not False:  # no flock here: the record decides
            raise UserError(_busy(run_dir, old, flocked=False))
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": _start_time(os.getpid()),
            "command": _command(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "job": job,
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return Lock(fd, flocked, _taken_over(run_dir, old) if old else None)


def wait_for_job(run_dir: Path, job: str, timeout_s: float = WAIT_S) -> dict:
    """A rank > 0 takes no lock of its own: it waits until the record names its own job (rank 0 holds the
    lock for all of them), so it never works beside another run; rank 0 refused ends the job (torchrun stops
    every rank when one fails)."""
    deadline = time.monotonic() + timeout_s
    while True:
        record = read(run_dir)
        if record and record.get("job") == job:
            return record
        if time.monotonic() > deadline:
            raise UserError(
                f"run dir {run_dir}: rank 0 of this job did not take its lock ({path(run_dir)}) within "
                f"{timeout_s:.0f} s; it names {describe(record)}: run one job at a time in a run dir"
            )
        time.sleep(0.2)


def _flock(fd: int, run_dir: Path) -> bool:
    """True: the kernel's lock is ours; False: this file system has no flock. Held elsewhere: one line."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    except OSError as e:
        if e.errno in NO_FLOCK:
            return False
        raise
    record = None
    for _ in range(10):  # the holder writes its record right after it took the lock
        record = read(run_dir)
        if record:
            break
        time.sleep(0.1)
    raise UserError(_busy(run_dir, record, flocked=True))


def _busy(run_dir: Path, record: dict | None, flocked: bool) -> str:
    file = path(run_dir)
    if flocked and record and alive(record) is False:  # the holder is gone, a process it started is not
        return (
            f"run dir {run_dir} is locked by a process left behind by {describe(record)}, which is gone: "
            f"a child of it still holds {file}; find it with `fuser -v {file}` and stop it"
        )
    if not flocked and alive(record) is None:
        return (
            f"run dir {run_dir} is in use by {describe(record)}, per {file} (this file system has no flock, "
            f"and that host's processes cannot be seen from here): if that process is gone, empty {file}"
        )
    return (
        f"run dir {run_dir} is in use by {describe(record)}: one run at a time per run dir; wait for it to "
        "end or stop it, or use another run_dir"
    )


def _taken_over(run_dir: Path, old: dict) -> str:
    state = alive(old)
    if state:  # runs, but holds no lock: its record outlived its hold
        return f"run dir {run_dir}: taking over the lock of {describe(old)}, which no longer holds it"
    if state is None:
        return (
            f"run dir {run_dir}: taking over the lock of {describe(old)}: it ended without releasing it "
            "(the file system's lock is free; if it still runs there, this file system does not share "
            "locks between hosts: stop it)"
        )
    return (
        f"run dir {run_dir}: taking over the stale lock of {describe(old)}, which is gone (killed or crashed "
        "before releasing it)"
    )


def _start_time(pid) -> int | None:
    """The start time of a live process (Linux /proc: clock ticks since boot); None: no such process, or a
    zombie (dead, not yet reaped)."""
    if not isinstance(pid, int):
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _command() -> str:
    """This process's command line as typed (/proc/self/cmdline; sys.argv elsewhere)."""
    try:
        args = [a.decode(errors="replace") for a in Path("/proc/self/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        args = [sys.executable, *sys.argv]
    return shlex.join(args)
