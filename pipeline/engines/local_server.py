"""An OpenAI-compatible server that eaglepipe starts for the target, and always stops (`prepare.regenerate_server`).

    with local_server.serving(cfg.prepare.regenerate_server, folder, log_path) as url:  # None: engine=none
        ...  # url = "http://127.0.0.1:<port>", answering /health and /v1/models

The launch line is built for the target's HF folder (SGLang's `sglang.launch_server`, vLLM's OpenAI api_server)
or taken as given (`engine=command`: any OpenAI-compatible server, the external boundary the tests cross with a
small HTTP server script). The server runs in its own session (process group), its output goes to `log_path`;
readiness is GET /health and GET /v1/models both answering 200 (a server that exits first, or is not ready
within `startup_timeout_s`, is one line with the log's last lines). On every way out of the block (normal,
exception, Ctrl-C, SIGTERM) exactly that process group is stopped: SIGTERM, then SIGKILL after a grace time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

from pipeline.errors import UserError

log = logging.getLogger(__name__)
GRACE_S = 10.0  # SIGTERM to SIGKILL


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_line(sc, model: Path, port: int, served_name: Optional[str] = None,
                concurrency: Optional[int] = None) -> list[str]:
    """`served_name`: the model name requests will send (prepare.regenerate_model or the target's name); vLLM
    answers 404 to any other, so the server is told to answer to it. `concurrency`: the requests prepare keeps in
    flight; SGLang captures decode CUDA graphs up to that batch (unless `args` says otherwise): on the H200 its
    default stopped short of 512 running requests, whose decode then ran without graphs at 17.9K tokens/s, against
    64.7K at 150 with them (2026-12-03, server log)."""
    engine = sc.engine.value if hasattr(sc.engine, "value") else str(sc.engine)
    python = sc.python or sys.executable
    named = ["--served-model-name", served_name] if served_name else []
    if engine == "sglang":
        line = [python, "-m", "sglang.launch_server", "--model-path", str(model), "--host", sc.host, "--port", str(port),
                *named]
        line += ["--mem-fraction-static", str(sc.mem_fraction)] if sc.mem_fraction is not None else []
        if concurrency and "--cuda-graph-max-bs" not in [str(a) for a in sc.args]:
            line += ["--cuda-graph-max-bs", str(concurrency)]
    elif engine == "vllm":
        line = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", sc.host,
                "--port", str(port), *named]
        line += ["--gpu-memory-utilization", str(sc.mem_fraction)] if sc.mem_fraction is not None else []
    elif engine == "command":
        if not sc.command:
            raise UserError("prepare.regenerate_server.engine=command needs prepare.regenerate_server.command "
                            "(the launch line, a list; {model}, {host}, {port} are filled in)")
        line = [str(a).format(model=model, host=sc.host, port=port, python=python) for a in sc.command]
    else:
        raise UserError(f"prepare.regenerate_server.engine={engine}: expected sglang, vllm or command")
    return line + [str(a) for a in sc.args]


@contextlib.contextmanager
def serving(sc, model: Path, log_path: Path, served_name: Optional[str] = None,
            concurrency: Optional[int] = None) -> Iterator[Optional[str]]:
    """The server's base URL while the block runs; None (nothing started) for engine=none. `served_name`: the model
    name the requests send (launch_line)."""
    engine = sc.engine.value if hasattr(sc.engine, "value") else str(sc.engine)
    if engine == "none":
        yield None
        return
    port = sc.port or free_port(sc.host)
    line = launch_line(sc, model, port, served_name, concurrency)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **{str(k): str(v) for k, v in sc.env.items()}}
    log.info("regenerate server: %s (log %s)", " ".join(line), log_path)
    with open(log_path, "ab") as out, _sigterm_raises():
        proc = subprocess.Popen(line, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        pgid = proc.pid  # a new session's leader: its process group id is its pid
        try:
            url = f"http://{sc.host}:{port}"
            wait_ready(proc, url, sc.startup_timeout_s, log_path)
            log.info("regenerate server ready at %s (pid %d)", url, proc.pid)
            yield url
        finally:
            stop(proc, pgid)


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, log_path: Path) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise UserError(f"regenerate server exited with code {proc.returncode} before it was ready; "
                            f"last lines of {log_path}: {tail(log_path)}")
        try:
            if all(httpx.get(url + path, timeout=5.0).status_code == 200 for path in ("/health", "/v1/models")):
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise UserError(f"regenerate server at {url} not ready after {timeout_s:.0f} s "
                            f"(prepare.regenerate_server.startup_timeout_s); last lines of {log_path}: {tail(log_path)}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen, pgid: int) -> None:
    """SIGTERM to the server's process group, SIGKILL to it if any of it is left after GRACE_S; only that group."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break  # the whole group is gone
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader: a zombie still counts as a member of its group
            if not _group_alive(pgid):
                break
            time.sleep(0.1)
        else:
            continue
        break
    proc.poll()
    log.info("regenerate server stopped (process group %d)", pgid)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "(no log)"
    return " | ".join(s.strip() for s in text if s.strip()) or "(empty)"


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM ends the process through Python's exits (SystemExit), so the server is stopped on the way out;
    only in the main thread (signal handlers can only be set there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
