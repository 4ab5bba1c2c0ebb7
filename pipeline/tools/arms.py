"""Ablation arms over one finished base run (issue #47 item 4): each arm is `eaglepipe stage=all` in its own
run dir whose prepared set and feature store are the base run's (linked, never copied: prepare and extract are
skipped as up to date, since an arm's overrides touch neither), so every arm trains on the same data at the
same budget (train.max_steps) and evaluates on the same prompts. Arms run `--parallel` at a time (a 135M
target's draft leaves most of an H100 idle). Then one table: per arm, training's validation (full_acc_0,
token_acc_0, at evaluate's positions), tau(3) per set with its interval, train tokens/s, wall seconds.

    python scripts/bench/arms.py BASE_RUN OUT_DIR NAME --parallel 3 --common "k=v ..." \
        --arm base= --arm vocab16k="vocab.draft_vocab_size=16000" ...
writes OUT_DIR/<arm>/ (run dirs, logs) and NAME.json ($OUT, else scripts/bench/results). The base run's own
overrides go in --common; an arm that changes data, prepare, extract or the target is refused.
"""

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pipeline.formats import bench_results  # noqa: E402

SHARED = ("prepared", "features")


def start(base: Path, out: Path, name: str, overrides: list[str], common: list[str]) -> subprocess.Popen:
    run = out / name
    run.mkdir(parents=True, exist_ok=True)
    for d in SHARED:
        if not (run / d).exists():
            (run / d).symlink_to((base / d).resolve())
    if not (run / "stages.json").exists():
        shutil.copy(base / "stages.json", run / "stages.json")
    cmd = [sys.executable, "-m", "pipeline", "stage=all", *common, f"run_dir={run}", *overrides]
    log = open(out / f"{name}.log", "w")
    log.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
    log.flush()
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONUNBUFFERED": "1"}
    )


def row(run: Path) -> dict:
    def read(p):
        return json.loads(p.read_text()) if p.is_file() else {}

    summary = read(run / "train" / "final" / "train_summary.json")
    sets = read(run / "eval" / "sets.json")
    val = summary.get("val_after") or {}
    return {
        "val": {
            k: val.get(k) for k in ("full_acc_0", "evalpos_full_acc_0", "token_acc_0", "evalpos_token_acc_0")
        },
        "tau_k3": {s: (r.get("tau") or {}).get("3") for s, r in sets.items()},
        "tau_k3_ci95": {s: (r.get("tau_ci95") or {}).get("3") for s, r in sets.items()},
        "teacher_forced_acc_0": {s: r.get("teacher_forced_acc_0") for s, r in sets.items()},
        "train_tokens": summary.get("train_tokens"),
        "optimizer_steps": summary.get("optimizer_steps"),
        "throughput": summary.get("throughput"),
        "peak_memory": summary.get("peak_memory"),
        "stage_seconds": {k: v.get("seconds") for k, v in read(run / "stages.json").items()},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("name")
    ap.add_argument("--parallel", type=int, default=3)
    ap.add_argument("--common", default="", help="overrides every arm gets (the base run's own, the budget)")
    ap.add_argument("--arm", action="append", default=[], help="NAME=override override ... (NAME= : none)")
    a = ap.parse_args(argv)
    if not (a.base / "stages.json").is_file():
        sys.exit(f"arms: {a.base} is not a run dir with finished stages (no stages.json)")
    arms = {s.split("=", 1)[0]: shlex.split(s.split("=", 1)[1]) if "=" in s else [] for s in a.arm}
    # the prepared set and the store are the base run's, linked: an arm that changed them would rebuild them
    # in place, under every other arm
    if a.parallel < 1:
        sys.exit("arms: --parallel must be 1 or more")
    touch = ("data", "prepare", "extract", "target", "experiment")  # an experiment: in --common only
    shared = [o for o in sum(arms.values(), []) if o.lstrip("+~").startswith(touch)]
    if shared:
        sys.exit(
            f"arms: {shared} would change the shared prepared set or store; make another base run for it"
        )
    common = shlex.split(a.common)
    res = bench_results.header(a.name, base=str(a.base), common=common, arms=arms, parallel=a.parallel)
    try:
        res["device"] = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
            ).stdout.strip()
            or "cpu"
        )
    except FileNotFoundError:
        res["device"] = "cpu"
    t0, pending, running, rc, wall = time.time(), list(arms), {}, {}, {}
    while pending or running:
        while pending and len(running) < a.parallel:
            n = pending.pop(0)
            running[n] = (start(a.base, a.out, n, arms[n], common), time.time())
        time.sleep(2)
        for n, (p, t) in list(running.items()):
            if p.poll() is not None:
                rc[n], wall[n] = p.returncode, round(time.time() - t, 1)
                print(f"arm {n}: rc {p.returncode}, {wall[n]} s", flush=True)
                del running[n]
    res["wall_s"] = round(time.time() - t0, 1)
    res["rows"] = {n: {"rc": rc[n], "wall_s": wall[n], **row(a.out / n)} for n in arms}
    path = bench_results.write(
        res, a.name, Path(__file__).resolve().parents[2] / "scripts" / "bench" / "results"
    )
    print(
        f"{'arm':<12}{'rc':>4}{'wall':>7}{'full0':>7}{'full0@e':>8}{'tok0':>7}{'tok0@e':>8}  tau(3) per set"
    )
    for n, r in res["rows"].items():
        v = r["val"]
        f = lambda x: f"{x:.3f}" if isinstance(x, float) else "-"  # noqa: E731
        taus = " ".join(f"{s}={f(t)}" for s, t in r["tau_k3"].items())
        print(
            f"{n:<12}{r['rc']:>4}{r['wall_s']:>7}{f(v['full_acc_0']):>7}{f(v['evalpos_full_acc_0']):>8}"
            f"{f(v['token_acc_0']):>7}"
            f"{f(v['evalpos_token_acc_0']):>8}  {taus}"
        )
    print("->", path)
