"""One runner for every GPU plan: a plan is data (scripts/gpu/plans/NAME.json); this starts, waits, collects.

    python3 scripts/gpu/plan.py start NAME      # copies the tree, runs the plan detached (setsid); returns
    python3 scripts/gpu/plan.py wait NAME SECS  # until done/failed or SECS: log tail, disk use; rc 0/1/2
    python3 scripts/gpu/plan.py collect NAME    # results + a tarball of logs into $OUT (<= 8 files, 16 MiB)
    python3 scripts/gpu/plan.py status NAME     # the jobs so far   (`stop NAME`: ends the plan, its servers)

A plan: {"description", "env": {VAR: value}, "logs": [globs], "jobs": [{"name", "command" (bash; a list is
joined by spaces), "env", "on_failure": "stop" | "continue", "collect": [globs], "show": lines,
"server": {"port", "health_path", "timeout_s"}}]}. Env values may use $VAR of the env before them, $PWD (the
tree's copy: every job runs there), $PLAN_DIR (the state dir), $SOURCE_TREE. Globs are relative to $PLAN_DIR;
jobs get OUT=$PLAN_DIR/out and COMMIT. A server job starts in its own session, is waited for until its health
path answers, and is stopped at the plan's end (or failure) by killing its own process group, nothing else.
State: $EAGLEPIPE_PLANS (default /tmp/eaglepipe-plans)/NAME/: state.json (every job's rc and wall time),
plan.log, logs/JOB.log, code/ ($EAGLEPIPE_PLAN_TREE, default this repo, less .git .venv* .gpu* runs).
"""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_FILES, MAX_BYTES = 8, 16 * 2**20
DETACHED = {"stderr": subprocess.STDOUT, "stdin": subprocess.DEVNULL}


def state_dir(name: str) -> Path:
    return Path(os.environ.get("EAGLEPIPE_PLANS", "/tmp/eaglepipe-plans")) / name


def load_plan(path: str | Path) -> dict:
    p = Path(path)
    if not p.suffix:
        p = HERE / "plans" / f"{p}.json"
    plan = json.loads(p.read_text()) | {"name": p.stem}
    for j in plan.get("jobs") or []:
        if isinstance(j, dict) and isinstance(j.get("command"), list):
            j["command"] = " ".join(j["command"])
    return plan


def check_plan(plan: dict) -> list[str]:
    """What is wrong with a plan, one line each (empty: well formed)."""
    bad, names = [], set()
    for i, j in enumerate(plan.get("jobs") or [None]):
        if not isinstance(j, dict) or not j.get("name") or not j.get("command"):
            bad.append(f"job {i}: needs a name and a command")
            continue
        if j["name"] in names or not re.fullmatch(r"[\w.-]+", j["name"]):
            bad.append(f"job {j['name']!r}: names must be unique words")
        names.add(j["name"])
        if j.get("on_failure", "stop") not in ("stop", "continue"):
            bad.append(f"job {j['name']}: on_failure is stop or continue")
        if "server" in j and not isinstance(j["server"].get("port"), int):
            bad.append(f"job {j['name']}: a server needs an integer port")
        unknown = set(j) - {"name", "command", "env", "on_failure", "collect", "show", "server"}
        bad += [f"job {j['name']}: unknown key {k!r}" for k in sorted(unknown)]
    return bad


def expand(value: str, env: dict) -> str:
    """$VAR / ${VAR} from env (unknown: empty), as the shell would."""
    return re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda m: env.get(m[1] or m[2], ""), value)


def read_state(d: Path) -> dict:  # written by os.replace: never half a file
    return json.loads((d / "state.json").read_text()) if (d / "state.json").is_file() else {}


def write_state(d: Path, state: dict) -> None:
    (d / "state.json.tmp").write_text(json.dumps(state, indent=1))
    os.replace(d / "state.json.tmp", d / "state.json")


def alive(pgid: int | None) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError, TypeError):
        return False


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group the server leads (its own session), SIGKILL after 15 s."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        if alive(proc.pid):
            os.killpg(proc.pid, sig)
        t = time.time()
        while (proc.poll() is None or alive(proc.pid)) and time.time() - t < grace:
            time.sleep(0.2)


def start(name: str) -> None:
    plan = load_plan(name)
    if problems := check_plan(plan):
        sys.exit("plan: " + "; ".join(problems))
    d = state_dir(plan["name"])
    if alive(read_state(d).get("pgid")):
        sys.exit(f"plan {plan['name']} is running; `stop` it first")
    tree = Path(os.environ.get("EAGLEPIPE_PLAN_TREE") or HERE.parents[1]).resolve()
    shutil.rmtree(d, ignore_errors=True)
    skip = re.compile(r"\.git|\.venv.*|\.gpu.*|runs")  # at the top level only
    shutil.copytree(
        tree, d / "code", ignore=lambda at, ns: [n for n in ns if at == str(tree) and skip.fullmatch(n)]
    )
    git = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(  # the tree a device receives may be ahead of the .git it carries
        ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    commit = os.environ.get("COMMIT") or (git.stdout.strip() + "+uncommitted" * bool(dirty)) or "unknown"
    (d / "code" / "COMMIT").write_text(commit + "\n")
    (d / "plan.json").write_text(json.dumps(plan, indent=1))
    write_state(d, {"plan": plan["name"], "commit": commit, "status": "starting", "source_tree": str(tree)})
    with open(d / "plan.log", "w") as log:
        argv = [sys.executable, __file__, "_run", plan["name"]]
        p = subprocess.Popen(argv, cwd=d / "code", stdout=log, start_new_session=True, **DETACHED)
    print(f"plan {plan['name']} started: pgid {p.pid}, commit {commit}, state {d}")


def run_job(d: Path, job: dict, env: dict, servers: dict, tick) -> int:
    log = open(d / "logs" / f"{job['name']}.log", "w")
    server = "server" in job  # its own session: its process group is stopped at the plan's end
    p = subprocess.Popen(
        ["bash", "-c", job["command"]], env=env, stdout=log, **DETACHED, start_new_session=server
    )
    while not server:
        if (rc := p.poll()) is not None:
            return rc
        tick()
        time.sleep(0.2)
    servers[job["name"]] = p
    s = job["server"]
    url = f"http://127.0.0.1:{s['port']}{s.get('health_path', '/health')}"
    t0 = time.time()
    while time.time() - t0 < s.get("timeout_s", 300) and p.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    print(f"{job['name']} up in {time.time() - t0:.0f} s (pgid {p.pid})")
                    return 0
        except OSError:  # not listening yet, or not healthy yet
            pass
        time.sleep(0.5)
    print(f"{job['name']} DID NOT START (rc {p.poll()})")
    return p.poll() or 1


def _run(name: str) -> None:
    d = state_dir(name)
    plan, state = json.loads((d / "plan.json").read_text()), read_state(d)
    for sub in ("logs", "out"):
        (d / sub).mkdir(exist_ok=True)
    base = {**os.environ, "PWD": str(d / "code"), "PLAN_DIR": str(d), "OUT": str(d / "out")}
    base |= {"COMMIT": state["commit"], "SOURCE_TREE": state["source_tree"]}
    for k, v in (plan.get("env") or {}).items():
        base[k] = expand(str(v), base)
    disk0 = shutil.disk_usage(d).used
    state |= {"status": "running", "pgid": os.getpgrp(), "jobs": [], "disk_used_start_bytes": disk0}
    state["disk_used_peak_bytes"] = disk0
    servers: dict[str, subprocess.Popen] = {}

    def tick(every=5.0):  # the disk's peak, sampled while jobs run (the H200 has 64 GB of disk)
        if time.time() - state.setdefault("sampled", 0) >= every:
            state["sampled"] = time.time()
            state["disk_used_peak_bytes"] = max(state["disk_used_peak_bytes"], shutil.disk_usage(d).used)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.stdout.reconfigure(line_buffering=True)
    try:
        for job in plan["jobs"]:
            env = dict(base)
            for k, v in (job.get("env") or {}).items():
                env[k] = expand(str(v), env)
            print(f"=== {job['name']} {time.strftime('%T')}")
            rec = {"name": job["name"], "command": expand(job["command"], env), "rc": None}
            state["jobs"].append(rec)
            write_state(d, state)
            t0 = time.time()
            rec["rc"] = run_job(d, job, env, servers, tick)
            rec["wall_s"] = round(time.time() - t0, 2)
            if "server" in job:
                rec["pgid"] = servers[job["name"]].pid
            tick(0)
            write_state(d, state)
            lines = (d / "logs" / f"{job['name']}.log").read_text(errors="replace").splitlines()
            show = job.get("show", 3) if rec["rc"] == 0 else 20  # a failure shows its log's last 20 lines
            tail = [
                *lines[max(0, len(lines) - show) :],
                f"--- {job['name']}: rc {rec['rc']}, {rec['wall_s']} s",
            ]
            print(*tail, sep="\n")
            if rec["rc"] != 0 and job.get("on_failure", "stop") == "stop":
                state["status"] = "failed"
                break
        else:
            state["status"] = "done"
    finally:
        for s in servers.values():
            stop_group(s)
        state["status"] = "failed" if state["status"] == "running" else state["status"]
        state["servers_stopped"] = {n: not alive(p.pid) for n, p in servers.items()}
        write_state(d, state)
        print(f"=== plan {state['status']} {time.strftime('%T')}")


def wait(name: str, seconds: float) -> int:
    d, t0 = state_dir(name), time.time()
    while (state := read_state(d)).get("status") not in ("done", "failed") and time.time() - t0 < seconds:
        if not alive(state.get("pgid")) and read_state(d).get("status") == "running":
            state |= {"status": "failed", "died": True}  # the runner is gone (killed, or /tmp was reset)
            write_state(d, state)
            break
        time.sleep(0.5)
    log = (d / "plan.log").read_text(errors="replace").splitlines() if (d / "plan.log").exists() else []
    print(*log[-40:], sep="\n")
    du = shutil.disk_usage(d if d.exists() else "/")
    print(f"disk: {du.used / 2**30:.1f} GiB used, {du.free / 2**30:.1f} free; status {state.get('status')}")
    return {"done": 0, "failed": 1}.get(state.get("status"), 2)


def collect(name: str) -> None:
    d, out = state_dir(name), Path(os.environ.get("OUT") or sys.exit("collect: $OUT is not set"))
    plan, left = json.loads((d / "plan.json").read_text()), []
    out.mkdir(parents=True, exist_ok=True)
    tgz = out / f"{name}_logs.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        for pat in ["plan.log", "state.json", "plan.json", "logs/*.log", *plan.get("logs", [])]:
            for f in sorted(glob.glob(str(d / pat))):
                tar.add(f, arcname=os.path.relpath(f, d))
    files = [f for j in plan["jobs"] for pat in j.get("collect", []) for f in sorted(glob.glob(str(d / pat)))]
    kept = []
    for f in map(Path, [tgz, *dict.fromkeys(files)]):
        if f.stat().st_size > MAX_BYTES:
            left.append(f"{f} ({f.stat().st_size} bytes > {MAX_BYTES})")
        elif len(kept) >= MAX_FILES:
            left.append(f"{f} (over {MAX_FILES} files)")
        elif f == tgz:
            kept.append(f)
        else:
            name = os.path.relpath(f, d).removeprefix("out/").replace("/", "_")  # run/x/a.json: run_x_a.json
            kept.append(Path(shutil.copy(f, out / name)))
    if tgz not in kept:
        tgz.unlink()
    print("collected:", *(f.name for f in kept))
    print("left out:", *left or ["nothing"], sep="\n  ")


def status(name: str) -> None:
    state = read_state(state_dir(name))
    print(f"plan {name}: {state.get('status', 'not started')}, runner alive: {alive(state.get('pgid'))}")
    for j in state.get("jobs", []):
        print(f"  {j['name']:<20} rc {j['rc']!s:>4}  {j.get('wall_s', '-')!s:>8} s")


def stop(name: str) -> None:
    pgid = read_state(state_dir(name)).get("pgid")
    if alive(pgid):
        os.killpg(pgid, signal.SIGTERM)  # the runner stops its servers on the way out
    print(f"plan {name}: stopped" if pgid else f"plan {name}: not running")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "wait":
        sys.exit(wait(Path(args[0]).stem, float(args[1])))
    actions = {"start": start, "_run": _run, "status": status, "stop": stop, "collect": collect}
    actions[cmd](args[0] if cmd == "start" else Path(args[0]).stem)
