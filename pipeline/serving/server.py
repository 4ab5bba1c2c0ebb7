"""A server started for a measurement: its own process group (start_new_session), healthy or a reason why not,
stopped by that group's id alone (never by a name: other servers on the box are not ours)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    argv: list[str]
    url: str
    log_path: Path
    proc: subprocess.Popen | None = None

    @property
    def pgid(self) -> int | None:
        return self.proc.pid if self.proc else None  # start_new_session: the leader's pid is the group's id

    def alive(self) -> bool:
        """The group's leader still runs. Read without reaping it: a zombie leader keeps its group id
        reserved, so
        stop() can never signal another group that reused the number."""
        if self.proc is None or self.proc.returncode is not None:
            return False
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:
            return False

    def log_tail(self, n: int = 3) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return " | ".join(line.strip() for line in lines[-n:] if line.strip())

    def why_dead(self) -> str:
        tail = self.log_tail()
        return (
            f"exited with code {self.proc.returncode}"
            + (f"; its log ends: {tail}" if tail else "")
            + f" ({self.log_path})"
        )


def start(
    argv: list[str],
    port: int,
    log_path: Path,
    timeout_s: float,
    env: dict | None = None,
    host: str = "127.0.0.1",
    timeout_knob: str = "tune.start_timeout_s",
) -> tuple[Server, str | None]:
    """Start argv (its --host/--port already set to host:port) in a new session, with `env` added to this
    environment, and wait for GET /health. (server, None) once healthy; (server, reason) if it exited or was
    not
    healthy within timeout_s (then it is already stopped); the reason names `timeout_knob`."""
    import httpx

    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = Server(argv, f"http://{host}:{port}", log_path)
    with open(log_path, "wb") as out:
        try:
            server.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        except OSError as e:  # no such program: the launch line's (tune.launch_prefix) first word
            return server, f"cannot run {argv[0]!r}: {e.strerror}"
    log.info("server (pgid %d) starting: %s", server.pgid, " ".join(argv))
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if not server.alive():
                stop(server)  # its children too, if the leader left any
                return server, server.why_dead()
            try:
                if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                    return server, None
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    except BaseException:  # Ctrl-C or SIGTERM (sigterm_unwinds) while it starts: the caller has no handle yet
        stop(server)
        raise
    stop(server)
    return (
        server,
        f"not healthy within {timeout_s:.0f} s ({timeout_knob}); its log ends: {server.log_tail()} "
        f"({server.log_path})",
    )


def stop(server: Server, grace_s: float = 30.0) -> None:
    """SIGTERM to the server's process group, then (the leader gone, or after grace_s) SIGKILL to what is
    left of
    the group; the leader is reaped last, so the group id stays ours until then."""
    if server.proc is None or server.proc.returncode is not None:
        return
    _signal(server.pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while server.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal(server.pgid, signal.SIGKILL)  # children the leader left behind (SGLang's scheduler processes)
    server.proc.wait(timeout=30)
    log.info("server (pgid %d) stopped", server.pgid)


def _signal(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


@contextmanager
def sigterm_unwinds():
    """Inside, SIGTERM to this process raises SystemExit, so the `finally` blocks that stop its servers run
    (the
    default action would leave them running in their own sessions). Main thread only; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
