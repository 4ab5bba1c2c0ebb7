"""Issue #37 item 3: the draft vocabulary size chosen by measurement, one row per size, from a run of
scripts/gpu/plans/qwen_vocab.json (run dirs v<K>/ in the plan dir: the same prepared data, features, recipe
and prompts; only vocab.draft_vocab_size differs).

Per size: coverage of supervised tokens (in-sample: the ids counted on the same tokens, which overstates;
and held out: every 10th sample's tokens, covered by the ids the others count most), offline tau per prompt
set and k (evaluate's sets.json: heldout is the report half of held-out samples, never trained on or
selected on), teacher-forced step-0 accuracy, training throughput and peak memory, stage seconds.
Usage: python scripts/bench/qwen_vocab_report.py PLAN_DIR [NAME]   (writes NAME.json: $OUT, else results/)
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_json  # noqa: E402


def _json(p: Path):
    return json.loads(p.read_text()) if p.is_file() else None


def row(run: Path) -> dict:
    K = int(run.name[1:])
    report = _json(run / "vocab" / "report.json") or {}
    sets = _json(run / "eval" / "sets.json") or {}
    summary = _json(run / "train" / "final" / "train_summary.json") or {}
    return {
        "draft_vocab": K,
        "coverage_in_sample": report.get("coverage"),
        "coverage_heldout": (report.get("heldout_coverage_by_size") or {}).get(str(K)),
        "tau": {name: r.get("tau") for name, r in sets.items()},
        "tau_k3": {name: (r.get("tau") or {}).get("3") for name, r in sets.items()},
        "teacher_forced_acc_0": {name: r.get("teacher_forced_acc_0") for name, r in sets.items()},
        "val_full_acc_0": (summary.get("val_after") or {}).get("full_acc_0"),
        "train_tokens_per_s": (summary.get("throughput") or {}).get("tokens_per_s_median"),
        "peak_memory": summary.get("peak_memory"),
        "stage_seconds": {k: v.get("seconds") for k, v in (_json(run / "stages.json") or {}).items()},
    }


def main(plan: Path, name: str) -> None:
    runs = sorted((p for p in plan.glob("v[0-9]*") if p.is_dir()), key=lambda p: int(p.name[1:]))
    if not runs:  # never a results JSON of nothing
        sys.exit(f"qwen_vocab_report: {plan} has no v<K>/ run dirs; usage: PLAN_DIR [NAME]")
    planned = (plan / "state.json").is_file()  # a GPU plan's dir; else run dirs made by hand (the CPU run)
    res = bench_json.header(
        name, **({"command": "python3 scripts/gpu/plan.py start qwen_vocab"} if planned else {})
    )
    try:
        import torch

        res["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        res["device"] = "unknown"
    first = _json(runs[0] / "vocab" / "report.json") or {}
    res["coverage_by_size"] = first.get("coverage_by_size")
    res["heldout_coverage_by_size"] = first.get("heldout_coverage_by_size")
    res["ids_for_coverage"] = first.get("ids_for_coverage")
    res["supervised_tokens"] = first.get("supervised_tokens")
    stats = _json(runs[0] / "prepared" / "stats.json") or {}
    res["prepared"] = {
        k: stats.get(k) for k in ("data", "samples", "tokens", "supervised_tokens", "target_path")
    }
    res["rows"] = [row(r) for r in runs]
    out = bench_json.write(res, name, Path(__file__).parent / "results")
    for r in res["rows"]:
        print(r["draft_vocab"], r["coverage_heldout"], r["tau_k3"], r["train_tokens_per_s"])
    print("->", out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python scripts/bench/qwen_vocab_report.py PLAN_DIR [NAME]")
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "qwen_vocab")
