"""#37: a row per draft vocabulary size, from plan qwen_vocab's run dirs v<K>/. Usage: PLAN_DIR [NAME]"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_json import header, read, write  # noqa: E402

plan, name = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "qwen_vocab"
runs = sorted((p for p in plan.glob("v[0-9]*") if p.is_dir()), key=lambda p: int(p.name[1:]))
if not runs:  # never a results JSON of nothing
    sys.exit(f"qwen_vocab_report: {plan} has no v<K>/ run dirs; usage: PLAN_DIR [NAME]")
planned = read(plan / "state.json")  # a plan's dir; else run dirs made by hand: this command
res = header(name, **({"command": "python3 scripts/gpu/plan.py start qwen_vocab"} if planned else {}))
first, stats = read(runs[0] / "vocab" / "report.json"), read(runs[0] / "prepared" / "stats.json")
res |= {k: first.get(k) for k in ("coverage_by_size", "heldout_coverage_by_size", "ids_for_coverage")}
res["prepared"] = {k: stats.get(k) for k in ("data", "samples", "tokens", "supervised_tokens", "target_path")}
res["rows"] = []
for run in runs:  # coverage (held out where the store has 10+ shards), offline tau per set and k, training
    K, rep, sets = int(run.name[1:]), read(run / "vocab" / "report.json"), read(run / "eval" / "sets.json")
    summary = read(run / "train" / "final" / "train_summary.json")
    res["rows"].append(
        {
            "draft_vocab": K,
            "coverage_in_sample": rep.get("coverage"),
            "coverage_heldout": (rep.get("heldout_coverage_by_size") or {}).get(str(K)),
            "tau": {s: r.get("tau") for s, r in sets.items()},
            "teacher_forced_acc_0": {s: r.get("teacher_forced_acc_0") for s, r in sets.items()},
            "val_full_acc_0": (summary.get("val_after") or {}).get("full_acc_0"),
            "train_tokens_per_s": (summary.get("throughput") or {}).get("tokens_per_s_median"),
            "peak_memory": summary.get("peak_memory"),
            "stage_seconds": {k: v.get("seconds") for k, v in read(run / "stages.json").items()},
        }
    )
print("->", write(res, name, Path(__file__).parent / "results"))
