"""A recipe plan's run (plans recipe_large, serving, qwen_coder) gathered into one results JSON: the keys
of #31's, #37's and #47's bars (val_full_acc_0, teacher_forced_acc_0.<set>, tau_ci95.<set>,
online.speedup_c1.<set>, plan_device_s: seconds since $DEVICE_T0_FILE's time; tau_k3.<set>: offline,
held-out's report half; acceptance_pos0; online.accept_length.<set>; online.graphs_on.speedup_c<N>;
train_tokens; wall_s; commit; vocab_sweep where
$VOCAB_SWEEP names plan qwen_vocab's results) and what explains them (stage seconds, disk, prepare, train).
Usage: python scripts/bench/recipe_large_report.py PLAN_DIR [NAME]   (writes NAME.json)"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_json  # noqa: E402

_json = bench_json.read
TRAIN_KEYS = "optimizer_steps throughput peak_memory selected val_after".split()
PREPARE_KEYS = "samples tokens supervised_tokens truncated skipped_records dropped_samples changed_records "
PREPARE_KEYS = (PREPARE_KEYS + "regenerate mix leaks synthesize").split()
SWEEP_KEYS = "draft_vocab coverage_in_sample coverage_heldout tau_k3 train_tokens_per_s peak_memory".split()


def main(plan: Path, name: str) -> None:
    if not (plan / "state.json").is_file():  # never a results JSON of nothing
        sys.exit(f"recipe_large_report: {plan} has no state.json (not a plan dir); usage: PLAN_DIR [NAME]")
    run, state = plan / "run", _json(plan / "state.json")
    res = bench_json.header(name, command=f"python3 scripts/gpu/plan.py start {state.get('plan', name)}")
    import torch  # the GPU box's image has it

    res["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    chain = next((j for j in state.get("jobs", []) if j["name"] == "chain"), {})
    res["wall_s"], res["chain_command"] = chain.get("wall_s"), chain.get("command")
    res["stage_seconds"] = {k: v.get("seconds") for k, v in (_json(run / "stages.json") or {}).items()}
    res["disk_peak_bytes"] = state.get("disk_used_peak_bytes", 0) - state.get("disk_used_start_bytes", 0)
    stats = _json(run / "prepared" / "stats.json") or {}
    res["prepare"] = {k: stats.get(k) for k in PREPARE_KEYS}
    res["prepare"]["heldout_samples"] = len(stats.get("heldout_samples") or [])
    summary = _json(run / "train" / "final" / "train_summary.json") or {}
    res["train"] = {k: summary.get(k) for k in TRAIN_KEYS}
    metrics = run / "train" / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    res["train"]["tau_probes"] = [json.loads(x) for x in lines if '"tau"' in x]
    res["train_tokens"] = summary.get("train_tokens")
    sets = _json(run / "eval" / "sets.json") or {}
    res["tau_k3"] = {name: (r.get("tau") or {}).get("3") for name, r in sets.items()}
    res["tau"] = {name: r.get("tau") for name, r in sets.items()}
    res["tau_ci95"] = {name: (r.get("tau_ci95") or {}).get("3") for name, r in sets.items()}
    val = summary.get("val_after") or {}  # issue #47: training's figure beside evaluate's, at its positions
    res["val_full_acc_0"], res["val_evalpos_full_acc_0"] = (
        val.get("full_acc_0"),
        val.get("evalpos_full_acc_0"),
    )
    res["val_evalpos_token_acc_0"] = val.get("evalpos_token_acc_0")
    res["teacher_forced_acc_0"] = {name: r.get("teacher_forced_acc_0") for name, r in sets.items()}
    acc = _json(run / "eval" / "acceptance.json") or {}
    pos = ((acc.get("trained") or {}).get("3") or {}).get("accept_per_position")
    res["acceptance_per_position_k3"] = pos
    res["acceptance_pos0"] = pos[0] if pos else None
    res["online"] = online(run, sets)
    t0 = Path(os.environ.get("DEVICE_T0_FILE", "/nonexistent"))  # written by the first install call
    res["plan_device_s"] = round(time.time() - int(t0.read_text()), 1) if t0.is_file() else None
    sweep = _json(Path(os.environ["VOCAB_SWEEP"])) if os.environ.get("VOCAB_SWEEP") else {}
    if sweep:  # measured by its own plan (another run, its own data size): carried with its source named
        rows = [{k: r.get(k) for k in SWEEP_KEYS} for r in sweep["rows"]]
        res["vocab_sweep"] = {"source": sweep["bench"], "device": sweep["device"], "rows": rows}
    out = bench_json.write(res, name, Path(__file__).parent / "results")
    print(json.dumps({k: res[k] for k in ("wall_s", "train_tokens", "tau_k3", "acceptance_pos0")}))
    print(json.dumps(res["online"].get("graphs_on", {})), "->", out)


def online(run: Path, sets: dict) -> dict:
    """Per set: the server's accept length (online.json of eval/<set>/); the speedups of the firm bench."""
    out: dict = {"accept_length": {}, "graphs_on": {}, "offline_vs_online": {}}
    for name in sets or ["heldout"]:
        d = run / "eval" if name == "heldout" else run / "eval" / name
        o = _json(d / "online.json")
        if not o:
            continue
        al = o["speculative"].get("accept_length")
        out["accept_length"][name] = al
        tau3 = (sets.get(name, {}).get("tau") or {}).get("3")
        if al and tau3:
            out["offline_vs_online"][name] = al / tau3 - 1
        for conc, r in (o.get("by_concurrency") or {}).items():
            if r.get("speedup_median") is not None:
                out["graphs_on"].setdefault(f"by_set_{name}", {})[f"c{conc}"] = r
                out.setdefault(f"speedup_c{conc}", {})[name] = r["speedup_median"]
        if name == "heldout":
            out["servers"] = {side: o.get(side) for side in ("speculative", "baseline")}
            for conc, r in (o.get("by_concurrency") or {}).items():
                out["graphs_on"][f"speedup_c{conc}"] = r.get("speedup_median")
                out["graphs_on"][f"speedup_spread_c{conc}"] = r.get("speedup_spread")
    return out


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "recipe_large_h100")
