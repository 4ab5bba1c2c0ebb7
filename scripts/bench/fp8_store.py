"""Benchmark: the fp8 feature store against the bf16 one on real SmolLM2-135M states (CPU).

The same prepared chitchat samples are extracted twice (extract.store_dtype=bf16 and fp8_e4m3, the default
blosc_lz4 compressor); reports bytes per token of each store, their ratio, and the fp8 states' error against the
bf16 ones per token and layer (relative L2), and the extract wall times.

    .venv/bin/python scripts/bench/fp8_store.py [data.limit=64 prepare.max_len=512 ...]
Writes scripts/bench/results/fp8_store_cpu.json.
"""

import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.config import register  # noqa: E402
from pipeline.formats.feature_store import FeatureStore  # noqa: E402
from pipeline.runner import run_stages  # noqa: E402


def store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and ".zarr" in str(p))


def main(overrides: list[str]) -> None:
    register()
    work = Path(tempfile.mkdtemp(prefix="fp8bench"))
    base = ["target=smollm2", "data.limit=64", "prepare.max_len=512", *overrides]
    out = {"name": "fp8_store_cpu", "date": time.strftime("%Y-%m-%d"),
           "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
           "command": "python scripts/bench/fp8_store.py " + " ".join(overrides), "overrides": base, "stores": {}}
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        def cfg(run_dir, *extra):
            return compose(config_name="config", overrides=[*base, *extra, f"run_dir={run_dir}"])
        run_stages(cfg(work / "bf16", "stage=prepare"))
        shutil.copytree(work / "bf16" / "prepared", work / "fp8" / "prepared")
        for name, extra in (("bf16", []), ("fp8_e4m3", ["extract.store_dtype=fp8_e4m3"])):
            run_dir = work / ("bf16" if name == "bf16" else "fp8")
            t0 = time.time()
            run_stages(cfg(run_dir, *extra, "stage=extract"))
            store = FeatureStore(run_dir / "features")
            tokens = int(store.sample_lengths().sum())
            out["stores"][name] = {"extract_s": round(time.time() - t0, 1), "tokens": tokens,
                                   "bytes": store_bytes(run_dir / "features"),
                                   "bytes_per_token": store_bytes(run_dir / "features") / tokens}
    a, b = FeatureStore(work / "bf16" / "features"), FeatureStore(work / "fp8" / "features")
    errs = {"aux_hidden": [], "last_hidden": []}
    groups = {"aux_hidden": len(a.aux_layer_ids), "last_hidden": 1}
    for i in range(len(a)):
        x, y = a.sample(i), b.sample(i)
        for key, g in groups.items():
            ref, got = (t.float().reshape(t.shape[0], g, -1) for t in (x[key], y[key]))
            errs[key].append(((got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).flatten())
    for key, chunks in errs.items():
        e = torch.cat(chunks)
        out[f"{key}_rel_l2_per_token"] = {"mean": float(e.mean()), "p99": float(e.quantile(0.99)), "max": float(e.max())}
    out["fp8_over_bf16_bytes"] = out["stores"]["fp8_e4m3"]["bytes"] / out["stores"]["bf16"]["bytes"]
    out["raw_bf16_bytes_per_token"] = (len(a.aux_layer_ids) + 1) * a.hidden_size * 2 + 5
    (ROOT / "scripts" / "bench" / "results" / "fp8_store_cpu.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    shutil.rmtree(work)


if __name__ == "__main__":
    main(sys.argv[1:])
