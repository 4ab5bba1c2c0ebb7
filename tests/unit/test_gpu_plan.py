"""scripts/gpu/plan.py, the one GPU plan runner, run locally on tiny shell plans: start -> wait -> collect."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "scripts" / "gpu" / "plan.py"
sys.path.insert(0, str(RUNNER.parent))
sys.dont_write_bytecode = True  # no __pycache__ under scripts/ (its line count)
import plan as runner  # noqa: E402


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(RUNNER), *args], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def box(tmp_path):
    """A tree to copy (with a file named `health`, served by http.server), a state dir, an OUT folder."""
    tree = tmp_path / "tree"
    (tree / ".git").mkdir(parents=True)
    (tree / "runs").mkdir()
    (tree / "health").write_text("ok\n")
    (tree / "hello.txt").write_text("hi\n")
    env = {**os.environ, "EAGLEPIPE_PLANS": str(tmp_path / "state"), "EAGLEPIPE_PLAN_TREE": str(tree)}
    env.update(COMMIT="abc1234", OUT=str(tmp_path / "out"))
    return tmp_path, env


def write_plan(tmp_path: Path, name: str, jobs: list, **extra) -> str:
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps({"jobs": jobs, **extra}))
    return str(p)


def test_jobs_run_in_order_with_env_and_collect_into_out(box):
    tmp, env = box
    jobs = [
        {
            "name": "one",
            "command": "echo $GREETING > $OUT/one.json; cat hello.txt",
            "env": {"GREETING": "$WHO"},
        },
        {"name": "two", "command": ["test -f $OUT/one.json &&", "echo $COMMIT > $OUT/two.json"]},
    ]
    p = write_plan(tmp, "tiny", jobs, env={"WHO": "world"})
    assert "started" in cli(env, "start", p).stdout
    w = cli(env, "wait", "tiny", "30")
    assert w.returncode == 0, w.stdout + w.stderr
    state = json.loads((tmp / "state" / "tiny" / "state.json").read_text())
    assert state["status"] == "done" and state["commit"] == "abc1234"
    assert [(j["name"], j["rc"]) for j in state["jobs"]] == [("one", 0), ("two", 0)]
    assert all(j["wall_s"] >= 0 for j in state["jobs"])
    assert not (tmp / "state" / "tiny" / "code" / ".git").exists()
    assert not (tmp / "state" / "tiny" / "code" / "runs").exists()
    assert (tmp / "state" / "tiny" / "out" / "one.json").read_text() == "world\n"
    assert "hi" in (tmp / "state" / "tiny" / "logs" / "one.log").read_text()
    cli(env, "collect", "tiny")
    assert sorted(f.name for f in (tmp / "out").iterdir()) == ["tiny_logs.tgz"]  # no job named results


def test_a_failing_job_stops_the_plan_with_its_rc(box):
    tmp, env = box
    jobs = [
        {"name": "soft", "command": "exit 3", "on_failure": "continue"},
        {"name": "hard", "command": "echo broken; exit 7"},
        {"name": "never", "command": "touch $PLAN_DIR/never"},
    ]
    cli(env, "start", write_plan(tmp, "bad", jobs))
    w = cli(env, "wait", "bad", "30")
    assert w.returncode == 1 and "broken" in w.stdout
    state = json.loads((tmp / "state" / "bad" / "state.json").read_text())
    assert state["status"] == "failed"
    assert [(j["name"], j["rc"]) for j in state["jobs"]] == [("soft", 3), ("hard", 7)]
    assert not (tmp / "state" / "bad" / "never").exists()


def test_a_server_is_started_waited_for_and_its_process_group_stopped(box):
    tmp, env = box
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    jobs = [
        {
            "name": "web",
            "command": f"{sys.executable} -m http.server {port} --bind 127.0.0.1",
            "server": {"port": port, "health_path": "/health", "timeout_s": 20},
        },
        {"name": "ask", "command": f"curl -sf http://127.0.0.1:{port}/health > $OUT/health.json"},
    ]
    cli(env, "start", write_plan(tmp, "srv", jobs))
    assert cli(env, "wait", "srv", "40").returncode == 0
    state = json.loads((tmp / "state" / "srv" / "state.json").read_text())
    assert (tmp / "state" / "srv" / "out" / "health.json").read_text() == "ok\n"
    pgid = state["jobs"][0]["pgid"]
    assert state["servers_stopped"] == {"web": True}
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_collect_keeps_at_most_8_files_and_says_what_it_left_out(box):
    tmp, env = box
    make = (
        "for i in $(seq 1 10); do echo '{}' > $OUT/r$i.json; done; head -c 17000000 /dev/zero > $OUT/big.json"
    )
    jobs = [{"name": "many", "command": make, "collect": ["out/big.json", "out/r*.json"]}]
    cli(env, "start", write_plan(tmp, "many", jobs))
    assert cli(env, "wait", "many", "30").returncode == 0
    c = cli(env, "collect", "many")
    got = sorted(f.name for f in (tmp / "out").iterdir())
    assert len(got) == 8 and "many_logs.tgz" in got and "big.json" not in got
    assert "big.json" in c.stdout and "over 8 files" in c.stdout


def test_every_plan_is_well_formed():
    plans = sorted((ROOT / "scripts" / "gpu" / "plans").glob("*.json"))
    assert plans
    for p in plans:
        plan = runner.load_plan(p)
        assert runner.check_plan(plan) == [], p.name
        assert plan.get("description"), p.name
        servers = [j["server"]["port"] for j in plan["jobs"] if "server" in j]
        assert len(servers) == len(set(servers)), p.name


def test_check_plan_names_what_is_wrong():
    bad = {"jobs": [{"name": "a"}, {"name": "b", "command": "x", "on_failure": "retry", "colect": []}]}
    assert runner.check_plan(bad) == [
        "job 0: needs a name and a command",
        "job b: on_failure is stop or continue",
        "job b: unknown key 'colect'",
    ]
