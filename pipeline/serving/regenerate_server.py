"""An OpenAI-compatible server that eaglepipe starts for the target, and always stops
(`prepare.regenerate_server`).

    with regenerate_server.serving(cfg.prepare.regenerate_server, folder, log_path) as url:  # None:
    engine=none
        ...  # url = "http://127.0.0.1:<port>", answering /health

The launch line is built for the target's HF folder (SGLang's `sglang.launch_server`, vLLM's OpenAI
api_server) or taken as given (`engine=command`: any OpenAI-compatible server, the external boundary the tests
cross with a small HTTP server script). Its life is pipeline/serving/server.py's, as tune-serve's servers: its
own session (process group), output to `log_path`, ready when GET /health answers 200 (a server that exits
first, or is not ready within `startup_timeout_s`, is one line with its log's last lines). On every way out of
the block (normal, exception, Ctrl-C, SIGTERM) exactly that process group is stopped: SIGTERM, then SIGKILL
after a grace time.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from pipeline.errors import UserError
from pipeline.serving import server

log = logging.getLogger(__name__)
GRACE_S = 10.0  # SIGTERM to SIGKILL


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_line(
    sc, model: Path, port: int, served_name: str | None = None, concurrency: int | None = None
) -> list[str]:
    """`served_name`: the model name requests will send (prepare.regenerate_model or the target's name); vLLM
    answers 404 to any other, so the server is told to answer to it. `concurrency`: the requests prepare
    keeps in
    flight; SGLang captures decode CUDA graphs up to that batch (unless `args` says otherwise): on the H200
    its default stopped short of 512 running requests, whose decode then ran without graphs at 17.9K tokens/s,
    against
    64.7K at 150 with them (2026-12-03, server log)."""
    engine = sc.engine.value if hasattr(sc.engine, "value") else str(sc.engine)
    python = sc.python or sys.executable
    named = ["--served-model-name", served_name] if served_name else []
    if engine == "sglang":
        line = [
            python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model),
            "--host",
            sc.host,
            "--port",
            str(port),
            *named,
        ]
        line += ["--mem-fraction-static", str(sc.mem_fraction)] if sc.mem_fraction is not None else []
        if concurrency and "--cuda-graph-max-bs" not in [str(a) for a in sc.args]:
            line += ["--cuda-graph-max-bs", str(concurrency)]
    elif engine == "vllm":
        line = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            sc.host,
            "--port",
            str(port),
            *named,
        ]
        line += ["--gpu-memory-utilization", str(sc.mem_fraction)] if sc.mem_fraction is not None else []
    elif engine == "command":
        if not sc.command:
            raise UserError(
                "prepare.regenerate_server.engine=command needs prepare.regenerate_server.command "
                "(the launch line, a list; {model}, {host}, {port} are filled in)"
            )
        line = [str(a).format(model=model, host=sc.host, port=port, python=python) for a in sc.command]
    else:
        raise UserError(f"prepare.regenerate_server.engine={engine}: expected sglang, vllm or command")
    return line + [str(a) for a in sc.args]


@contextlib.contextmanager
def serving(
    sc, model: Path, log_path: Path, served_name: str | None = None, concurrency: int | None = None
) -> Iterator[str | None]:
    """The server's base URL while the block runs; None (nothing started) for engine=none. `served_name`: the
    model
    name the requests send (launch_line). Started and stopped by pipeline/serving/server.py, like
    tune-serve's."""
    engine = sc.engine.value if hasattr(sc.engine, "value") else str(sc.engine)
    if engine == "none":
        yield None
        return
    port = sc.port or free_port(sc.host)
    line = launch_line(sc, model, port, served_name, concurrency)
    log.info("regenerate server: %s (log %s)", " ".join(line), log_path)
    with server.sigterm_unwinds():
        proc, why = server.start(
            line,
            port,
            log_path,
            sc.startup_timeout_s,
            {str(k): str(v) for k, v in sc.env.items()},
            sc.host,
            "prepare.regenerate_server.startup_timeout_s",
        )
        if why:
            raise UserError(f"regenerate server: {why}")
        try:
            log.info("regenerate server ready at %s (process group %d)", proc.url, proc.pgid)
            yield proc.url
        finally:
            server.stop(proc, GRACE_S)
