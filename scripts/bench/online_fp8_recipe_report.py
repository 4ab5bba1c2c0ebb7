"""Collects what scripts/bench/online_fp8_recipe.sh's run dirs hold into one JSON (issues #16, #17, #14).

Per run dir: the seconds of each stage it ran itself (a cloned run dir's reused stages are listed apart), the
feature store's bytes and tokens, train's throughput, peak memory, val metrics before/after and the wall time at
the end of every epoch (metrics.jsonl `wall_s`), the tau probes logged during training, and the offline tau per
prompt set and k of the exported draft.
Usage: python scripts/bench/online_fp8_recipe_report.py PLAN_DIR OUT.json [command that ran]
"""

import json
import os
import re
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path


def _json(p: Path):
    return json.loads(p.read_text()) if p.is_file() else None


def _store(run: Path) -> dict:
    m = _json(run / "features" / "manifest.json")
    if not m:
        return {}
    tokens = sum(s["num_tokens"] for s in m["shards"])
    size = int(subprocess.run(["du", "-sb", str(run / "features")], capture_output=True, text=True).stdout.split()[0])
    return {"tokens": tokens, "bytes": size, "bytes_per_token": size / max(tokens, 1),
            "store_dtype": m["facts"].get("store_dtype", "bf16"), "compressor": m["facts"].get("compressor")}


def _train(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()] \
        if (run / "train" / "metrics.jsonl").is_file() else []
    if not rows:
        return {}
    trains = [r for r in rows if r["split"] == "train"]
    epoch_end = {}
    for r in trains:
        if "wall_s" in r:
            epoch_end[r["epoch"]] = {"step": r["step"], "wall_s": r["wall_s"]}
    keep = ("step", "loss", "full_acc_0", "full_acc_1", "full_acc_2")
    out = {"epoch_end": epoch_end, "val": [{k: r[k] for k in keep if k in r} for r in rows if r["split"] == "val"],
           "tau_probes": [r for r in rows if r["split"] == "tau"]}
    s = _json(run / "train" / "final" / "train_summary.json")
    if s:
        out.update({k: s.get(k) for k in ("optimizer_steps", "throughput", "peak_memory", "selected")})
        out["val_after"] = {k: v for k, v in s["val_after"].items() if k.startswith(("full_acc", "loss"))}
        out["ttt_steps"] = s["config"]["train"]["ttt_steps"]
        out["epochs"] = s["config"]["train"]["epochs"]
        out["features"] = s["config"]["train"]["features"]
    return out


def _eval(run: Path) -> dict:
    out = {}
    sets = _json(run / "eval" / "sets.json")
    if sets:
        out["sets"] = sets
    online = _json(run / "eval" / "sets_online.json")  # the export served by SGLang (eval.endpoint)
    if online:
        out["sets_online"] = online
    a = _json(run / "eval" / "acceptance.json")
    if a:
        out["heldout"] = {"prompts": a["prompts"], "max_new_tokens": a["max_new_tokens"],
                          "tau_trained": {k: v["tau"] for k, v in a["trained"].items()},
                          "tau_untrained": {k: v["tau"] for k, v in a["untrained"].items()},
                          "accept_per_position": {k: v["accept_per_position"] for k, v in a["trained"].items()},
                          "greedy_mismatches": sum(v["greedy_mismatches"] for v in a["trained"].values()),
                          "teacher_forced_acc_0": a.get("teacher_forced_acc_0")}
    return out


def _stage_seconds(plan: Path, name: str, st: dict) -> dict:
    """A cloned run dir carries its origin's stages.json, so a stage's seconds are this run's own only where the
    plan ran it here: from its log (logs/RUN.STAGE.log, the runner's "stage X: done in N s"; null when it did not
    finish). The stages it reused are listed apart. Without the plan's logs, stages.json as it is."""
    if not (plan / "logs").is_dir():
        return {"stage_seconds": {k: v.get("seconds") for k, v in st.items()}, "stages_reused": []}
    own, reused = {}, []
    for stage in st:
        log = plan / "logs" / f"{name}.{stage}.log"
        if not log.is_file():
            reused.append(stage)
            continue
        done = re.findall(rf"stage {stage}: done in ([0-9.]+) s", log.read_text(errors="replace"))
        own[stage] = float(done[-1]) if done else None
    return {"stage_seconds": own, "stages_reused": sorted(reused)}


def main(plan: Path, out: Path, command: str) -> None:
    runs = {}
    for run in sorted(p for p in plan.iterdir() if (p / "stages.json").is_file()):
        st = _json(run / "stages.json")
        runs[run.name] = {**_stage_seconds(plan, run.name, st),
                          "store": _store(run), "train": _train(run), "eval": _eval(run)}
    prof = {p.name: _json(p / "train_profile.json") for p in sorted(plan.glob("prof_*"))}
    try:
        import torch
        dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        tv = torch.__version__
    except ImportError:
        dev = tv = None
    res = {"bench": os.environ.get("BENCH_NAME", "online_fp8_recipe"),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "host": socket.gethostname(), "device": dev, "torch": tv, "cpus": os.cpu_count(), "command": command,
           "runs": runs, "train_profiles": prof, "sglang": _json(plan / "sgl" / "sglang_serving.json")}
    out.write_text(json.dumps(res, indent=1))
    for name, r in runs.items():
        t, e = r["train"], r["eval"]
        print(name, r["stage_seconds"], r["store"].get("bytes_per_token"), t.get("throughput"),
              (t.get("peak_memory") or {}).get("max_allocated_bytes"), t.get("val_after"),
              e.get("heldout", {}).get("tau_trained"), {k: v.get("tau") for k, v in e.get("sets", {}).items()})


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "")
