"""The server prepare starts (pipeline/serving/regenerate_server.py), on CPU: its launch line, readiness, and
that exactly its process group is stopped on every way out. The "engine" is tests/openai_test_server.py run
through
`engine=command` (the external boundary: any OpenAI-compatible server's launch line)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from omegaconf import OmegaConf

from pipeline.config import RegenerateServerConfig
from pipeline.config_choices import ServerEngine
from pipeline.errors import UserError
from pipeline.serving import regenerate_server as local_server

SERVER = str(Path(__file__).resolve().parents[1] / "openai_test_server.py")


def server_cfg(**kw):
    return OmegaConf.structured(RegenerateServerConfig(**kw))


def fake(**kw):
    return server_cfg(
        engine=ServerEngine.command,
        command=["{python}", SERVER, "--port", "{port}"],
        startup_timeout_s=30,
        **kw,
    )


def pid_in(log: Path) -> int:
    return int(re.search(r"test server pid (\d+)", log.read_text()).group(1))


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_launch_lines_for_the_engines_use_the_target_folder_port_and_extra_args(tmp_path):
    sg = server_cfg(engine=ServerEngine.sglang, python="/py", args=["--tp-size", "8"], mem_fraction=0.85)
    assert local_server.launch_line(sg, tmp_path, 31000) == [
        "/py",
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(tmp_path),
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--mem-fraction-static",
        "0.85",
        "--tp-size",
        "8",
    ]
    vl = server_cfg(engine=ServerEngine.vllm)
    assert local_server.launch_line(vl, tmp_path, 8000) == [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tmp_path),
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
    ]
    assert local_server.launch_line(vl, tmp_path, 8000, "smol")[-2:] == [
        "--served-model-name",
        "smol",
    ]  # vLLM 404s others
    # SGLang's decode graphs cover the batch prepare keeps in flight, unless the user's args set it
    assert local_server.launch_line(sg, tmp_path, 1, None, 256)[-4:] == [
        "--cuda-graph-max-bs",
        "256",
        "--tp-size",
        "8",
    ]
    own = server_cfg(engine=ServerEngine.sglang, args=["--cuda-graph-max-bs", "64"])
    assert local_server.launch_line(own, tmp_path, 1, None, 256).count("--cuda-graph-max-bs") == 1
    with pytest.raises(UserError, match="engine=command needs prepare.regenerate_server.command"):
        local_server.launch_line(server_cfg(engine=ServerEngine.command), tmp_path, 1)


def test_the_server_answers_inside_the_block_and_its_process_is_gone_after_it(tmp_path):
    log = tmp_path / "server.log"
    with local_server.serving(fake(env={"EAGLEPIPE_TEST_MARK": "1"}), tmp_path, log) as url:
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "test"
        pid = pid_in(log)
        assert os.getpgid(pid) == pid != os.getpgid(0)  # its own process group
    assert gone(pid)
    with local_server.serving(server_cfg(), tmp_path, log) as url:
        assert url is None  # engine=none starts nothing


def test_an_exception_in_the_block_stops_the_server_and_propagates(tmp_path):
    log = tmp_path / "server.log"
    with pytest.raises(KeyboardInterrupt):
        with local_server.serving(fake(), tmp_path, log):
            pid = pid_in(log)
            raise KeyboardInterrupt
    assert gone(pid)


def test_sigterm_to_eaglepipe_stops_the_server_it_started(tmp_path):
    log = tmp_path / "server.log"
    code = (
        "import sys, time; from pathlib import Path; from omegaconf import OmegaConf;"
        "from pipeline.config import RegenerateServerConfig; from pipeline.serving import regenerate_server "
        "as local_server;"
        f"sc = OmegaConf.structured(RegenerateServerConfig(engine='command', command=json_cmd));"
        f"cm = local_server.serving(sc, Path('.'), Path({str(log)!r}));"
        "url = cm.__enter__(); print('ready', flush=True); time.sleep(60)"
    )
    cmd = json.dumps(["{python}", SERVER, "--port", "{port}"])
    child = subprocess.Popen(
        [sys.executable, "-c", f"json_cmd = {cmd}; " + code], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "ready"
    pid = pid_in(log)
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == 128 + signal.SIGTERM
    assert gone(pid)


def test_a_server_that_exits_before_ready_is_one_line_with_its_log(tmp_path):
    sc = server_cfg(
        engine=ServerEngine.command,
        command=["{python}", "-c", "print('CUDA out of memory'); raise SystemExit(3)"],
    )
    with pytest.raises(
        UserError, match=r"regenerate server: exited with code 3; its log ends: CUDA out of memory"
    ):
        with local_server.serving(sc, tmp_path, tmp_path / "server.log"):
            pass


def test_a_server_not_ready_in_time_is_stopped_and_named_with_its_log(tmp_path):
    sc = server_cfg(
        engine=ServerEngine.command,
        startup_timeout_s=1,
        command=[
            "{python}",
            "-c",
            "import os, time; print('loading', os.getpid(), flush=True); time.sleep(60)",
        ],
    )
    t = time.monotonic()
    with pytest.raises(
        UserError,
        match=r"not healthy within 1 s \(prepare.regenerate_server.startup_timeout_s\); "
        r"its log ends: loading",
    ) as e:
        with local_server.serving(sc, tmp_path, tmp_path / "server.log"):
            pass
    assert gone(int(str(e.value).split("loading ")[1].split()[0])) and time.monotonic() - t < 15


def test_prepare_regenerates_through_the_server_it_starts(make_cfg, tmp_path, tiny_folder):
    from pipeline.formats.prepared import load as load_prepared
    from pipeline.stages import prepare

    requests = tmp_path / "requests.jsonl"
    cfg = make_cfg(
        "target=tiny",
        "data.limit=3",
        "prepare.regenerate=true",
        "prepare.regenerate_server.engine=command",
        f'prepare.regenerate_server.command=["{{python}}",{SERVER},--port,"{{port}}",--requests-log,{requests}]',
        run_dir=tmp_path / "r",
    )
    prepare.run(cfg)
    ds, stats = load_prepared(tmp_path / "r")
    log = tmp_path / "r" / "prepared.partial" / "server.log"
    assert gone(pid_in(log)) and stats["regenerate"]["backend"].startswith("endpoint http://127.0.0.1:")
    assert stats["regenerate"]["turns_replaced"] == len(requests.read_text().splitlines()) > 0
