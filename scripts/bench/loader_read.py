"""Benchmark (CPU, issue #14 item 2): what one training-loader worker reads per second from the feature store,
per zarr chunk length (`extract.chunk_tokens`), and how much it decodes to get it.

A pack takes a few samples in shuffled order; each sample is a row range inside a shard, and zarr decodes every
chunk the range touches in full. With 2,048-token chunks and ~450-token samples a worker decodes several times
the rows it uses. This bench writes the same states into stores that differ only in chunk length and times the
real loader path (`PackDataset` -> `collate`, one process = one DataLoader worker) over the same shuffled packs.

States are SYNTHETIC (this machine has no GPU to capture SmolLM2's): heavy-tailed bf16 like a residual stream,
at a target's widths (default SmolLM2: 3 aux layers x 576, last 576), written by the store's own ShardWriter
with the default compressor. Sample lengths are drawn around the SmolLM2 chitchat chain's mean (~450 tokens).
Usage: python scripts/bench/loader_read.py [--hidden 576] [--samples 2000] [--chunks 2048,512,256] [--store-dtype fp8_e4m3]
Writes scripts/bench/results/loader_read_cpu.json (fp8: loader_read_fp8_cpu.json; or the same names under $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.data.features_dataset import PackDataset, plan_packs  # noqa: E402
from pipeline.formats import feature_store as fs  # noqa: E402
from pipeline.stages.extract import plan_shards  # noqa: E402


def states(n: int, width: int, g: torch.Generator) -> torch.Tensor:
    """Most values small, a few channels ~100x larger (the residual stream's outlier features)."""
    x = torch.randn(n, width, generator=g)
    x[:, :: max(1, width // 8)] *= 100
    return x.bfloat16()


def write_store(root: Path, lengths: np.ndarray, hidden: int, n_aux: int, chunk: int, shard_tokens: int,
                dtype: str = "bf16") -> int:
    facts = {"aux_layer_ids": list(range(1, n_aux + 1)), "hidden_size": hidden, "target_fingerprint": "synthetic"}
    if dtype == fs.FP8:
        facts["store_dtype"] = fs.FP8
    manifest = fs.open_for_writing(root, facts)
    g = torch.Generator().manual_seed(0)  # the same states in every store
    for spec in plan_shards(lengths, shard_tokens):  # extract's own shard layout
        w = fs.ShardWriter(root, spec, facts, (n_aux * hidden, hidden), chunk, "blosc_lz4")
        for j, n in enumerate(spec.lengths):
            aux, last = states(n, n_aux * hidden, g), states(n, hidden, g)
            if dtype == fs.FP8:  # as extract writes it: bits and a scale per token and layer
                (aux, a_scale), (last, l_scale) = fs.encode_fp8(aux, n_aux), fs.encode_fp8(last, 1)
                w.write(j, np.arange(n, dtype=np.int32), np.ones(n, np.uint8), aux, last, (a_scale, l_scale))
            else:
                w.write(j, np.arange(n, dtype=np.int32), np.ones(n, np.uint8), aux, last)
        w.commit(manifest)
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--n-aux", type=int, default=3)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--mean-len", type=int, default=450)
    ap.add_argument("--chunks", default="2048,512,256")
    ap.add_argument("--tokens-per-pack", type=int, default=8192)
    ap.add_argument("--packs", type=int, default=60, help="packs timed per store (the same ones for each)")
    ap.add_argument("--store-dtype", default="bf16", choices=["bf16", fs.FP8],
                    help="fp8_e4m3: the loader also decodes fp8 bits x scales to bf16")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes over the packs per store (median kept)")
    a = ap.parse_args()
    torch.set_num_threads(1)  # one DataLoader worker
    lengths = np.clip(np.random.default_rng(0).gamma(4.0, a.mean_len / 4.0, a.samples), 16, 2048).astype(np.int64)
    packs = plan_packs(np.arange(a.samples), lengths, a.tokens_per_pack, seed=0, epoch=0)[: a.packs]
    used_tokens = sum(min(p[1] + a.tokens_per_pack, int(lengths[p[0]]) - 1) - p[1] for pack in packs for p in pack)
    row_bytes = (a.n_aux + 1) * a.hidden * 2
    res = {"bench": "loader_read", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": f"{platform.node()} ({platform.processor() or platform.machine()}, {os.cpu_count()} cpus)",
           "torch": torch.__version__, "command": "python scripts/bench/loader_read.py " + " ".join(sys.argv[1:]),
           "states": "synthetic heavy-tailed bf16 (no GPU here to capture real ones)", "hidden": a.hidden,
           "n_aux": a.n_aux, "store_dtype": a.store_dtype, "samples": a.samples, "mean_sample_tokens": float(lengths.mean()),
           "tokens_per_pack": a.tokens_per_pack, "packs_timed": len(packs), "repeats": a.repeats,
           "tokens_read": int(used_tokens),
           "per_chunk_tokens": {}}
    chunks = [int(c) for c in a.chunks.split(",")]
    roots = {c: Path(tempfile.mkdtemp(prefix=f"loader_read_{c}_")) for c in chunks}
    try:
        sizes = {c: write_store(roots[c], lengths, a.hidden, a.n_aux, c, 262144, a.store_dtype) for c in chunks}
        sets = {c: PackDataset(roots[c], packs, a.tokens_per_pack, pad=True) for c in chunks}
        for ds in sets.values():
            ds[0]  # opens the store and its groups, as a worker's first pack does
        times = {c: [] for c in chunks}
        for _ in range(a.repeats):  # interleaved: a noisy neighbour slows every store alike
            for c in chunks:
                t = time.perf_counter()
                for k in range(len(packs)):
                    sets[c][k]
                times[c].append(time.perf_counter() - t)
    finally:
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)
    offsets = np.concatenate([[0], np.cumsum(lengths)])  # global row of each sample (shards are contiguous)
    for c in chunks:
        decoded = sum(((offsets[i + 1] - 1) // c - offsets[i] // c + 1) * c for pack in packs for i, _, _ in pack)
        s = float(np.median(times[c]))
        r = {"store_bytes": sizes[c], "store_bytes_per_token": sizes[c] / lengths.sum(), "seconds_median": s,
             "seconds_all": times[c], "tokens_per_s": used_tokens / s, "state_MB_per_s": used_tokens * row_bytes / s / 1e6,
             "decode_amplification": decoded / used_tokens}  # approximate: chunks restart at shard edges
        res["per_chunk_tokens"][str(c)] = r
        print(f"chunk {c:>5}: {r['tokens_per_s']:>9,.0f} tokens/s per worker ({r['state_MB_per_s']:,.0f} MB/s of "
              f"states; median of {a.repeats}), ~{r['decode_amplification']:.1f}x rows decoded, "
              f"{r['store_bytes_per_token']:,.0f} B/token", flush=True)
    name = "loader_read" + ("" if a.store_dtype == "bf16" else "_fp8")
    out = Path(os.environ["OUT"]) / f"{name}.json" if os.environ.get("OUT") else \
        ROOT / "scripts" / "bench" / "results" / f"{name}_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
