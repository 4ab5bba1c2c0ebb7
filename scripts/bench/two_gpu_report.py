"""Gathers scripts/bench/two_gpu.sh's run dirs into one JSON (issue #18): per part, what each side measured and
the comparison the issue asks for. Whatever a part did not reach is left out, not guessed.
Usage:  python scripts/bench/two_gpu_report.py PLAN_DIR OUT.json "COMMAND"
"""

import json
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.formats import feature_store as fs  # noqa: E402


def _json(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _seconds(plan: Path, name: str):
    try:
        return float((plan / f"{name}.s").read_text())
    except (OSError, ValueError):
        return None


def files(features: Path) -> dict:
    """Every file of a store by relative path -> bytes (the manifest's lock file is empty on both sides)."""
    return {str(p.relative_to(features)): p.read_bytes() for p in sorted(features.rglob("*")) if p.is_file()}


def layout(features: Path) -> dict:
    """What a store's readers depend on, values aside: its facts, its shards (names, sample ranges, tokens) and
    each array's shape, dtype and chunks."""
    import zarr

    m = fs.read_manifest(features)
    arrays = {}
    for s in m["shards"]:
        g = zarr.open_group(str(features / s["name"]), mode="r")
        arrays[s["name"]] = {k: [list(a.shape), str(a.dtype), list(a.chunks)] for k, a in sorted(g.arrays())}
    return {"facts": m["facts"], "shards": m["shards"], "arrays": arrays}


def capture(plan: Path, name: str) -> dict | None:
    run = plan / name
    m = fs.read_manifest(run / "features")
    if not m or not m.get("complete"):
        return None
    tokens = sum(s["num_tokens"] for s in m["shards"])
    stage = (_json(run / "stages.json") or {}).get("extract", {}).get("seconds")
    return {"tokens": tokens, "shards": len(m["shards"]), "stage_s": stage, "wall_s": _seconds(plan, name),
            "tok_s_stage": tokens / stage if stage else None}


def training(plan: Path, name: str) -> dict | None:
    s = _json(plan / name / "train" / "final" / "train_summary.json")
    if not s:
        return None
    keep = ("world_size", "grad_accum", "strategy", "optimizer_steps", "throughput", "peak_memory", "val_after")
    out = {k: s.get(k) for k in keep}
    out["wall_s"] = _seconds(plan, name)
    out["plan_estimate"] = _json(plan / f"plan_{name}.json")
    return out


def _ratio(a, b, key):
    try:
        return b[key] / a[key]
    except (TypeError, KeyError, ZeroDivisionError):
        return None


def main(plan: Path, out: Path, command: str) -> None:
    res = {"bench": "two_gpu", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "host": socket.gethostname(), "command": command}
    try:
        import torch
        res["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] or ["cpu"]
        res["torch"] = torch.__version__
    except Exception:  # noqa: BLE001 - the report is still written
        pass
    tp = {n: capture(plan, f"tp{n}") for n in (1, 2)}
    if all(tp.values()):
        from pipeline.tools.parity import compare
        res["sglang_tp"] = {"tp1": tp[1], "tp2": tp[2], "tp2_over_tp1_tok_s": _ratio(tp[1], tp[2], "tok_s_stage"),
                            "layout_identical": layout(plan / "tp1" / "features") == layout(plan / "tp2" / "features"),
                            "parity_tp2_vs_tp1": compare(fs.FeatureStore(plan / "tp1" / "features"),
                                                         fs.FeatureStore(plan / "tp2" / "features"))}
    dp = {n: capture(plan, f"dp{n}") for n in (1, 2)}
    if all(dp.values()):
        res["hf_data_parallel"] = {"ranks1": dp[1], "ranks2": dp[2],
                                   "ranks2_over_ranks1_tok_s": _ratio(dp[1], dp[2], "tok_s_stage"),
                                   "ranks2_over_ranks1_wall": (dp[1]["wall_s"] / dp[2]["wall_s"]
                                                               if dp[1]["wall_s"] and dp[2]["wall_s"] else None),
                                   "store_byte_identical": files(plan / "dp1" / "features") == files(plan / "dp2" / "features")}
    for part, (a, b) in (("train_ddp", ("t1", "t2")), ("train_8b_shape_fsdp", ("f1", "f2"))):
        one, two = training(plan, a), training(plan, b)
        if one or two:
            r = {"one_gpu": one, "two_gpus": two}
            if one and two:
                t1, t2 = (x.get("throughput") or {} for x in (one, two))
                r["tokens_per_s_ratio"] = _ratio(t1, t2, "tokens_per_s_median")
                r["wall_ratio"] = one["wall_s"] / two["wall_s"] if one["wall_s"] and two["wall_s"] else None
                va, vb = one.get("val_after") or {}, two.get("val_after") or {}
                r["val_diff"] = {k: vb[k] - va[k] for k in va if k in vb and isinstance(va[k], (int, float))}
            res[part] = r
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k not in ("sglang_tp",)}, indent=1)[:4000])
    if "sglang_tp" in res:
        print(json.dumps({k: v for k, v in res["sglang_tp"].items() if k != "parity_tp2_vs_tp1"}))
        print(json.dumps(res["sglang_tp"]["parity_tp2_vs_tp1"]))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "")
