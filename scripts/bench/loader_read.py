"""Benchmark (CPU, issue #14 item 2): what one training-loader worker reads per second from the feature
store, per zarr chunk length (`extract.chunk_tokens`), and how much it decodes to get it (zarr decodes every
chunk a sample's row range touches). The same SYNTHETIC heavy-tailed bf16 states (SmolLM2's widths by default;
sample lengths around chitchat's ~450 tokens) go into stores that differ only in chunk length, written by the
store's own ShardWriter; the real loader path (`PackDataset` -> `collate`, one process = one worker) reads
the same shuffled packs from each.
Usage: python scripts/bench/loader_read.py [--chunks 2048,512,256] [--store-dtype fp8_e4m3]
Writes loader_read_cpu.json (fp8: loader_read_fp8_cpu.json) into $OUT, else scripts/bench/results/.
"""

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import bench_json
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.capture.store import plan_shards  # noqa: E402
from pipeline.data.features_dataset import PackDataset, plan_packs  # noqa: E402
from pipeline.formats import feature_store as fs  # noqa: E402
from pipeline.formats import store_writer as sw  # noqa: E402


def states(n: int, width: int, g: torch.Generator) -> torch.Tensor:
    """Most values small, a few channels ~100x larger (the residual stream's outlier features)."""
    x = torch.randn(n, width, generator=g)
    x[:, :: max(1, width // 8)] *= 100
    return x.bfloat16()


def write_store(root: Path, lengths: np.ndarray, a, chunk: int) -> int:
    """A store of synthetic states in extract's own shard layout, written by the store's own writer."""
    hidden, n_aux, dtype = a.hidden, a.n_aux, a.store_dtype
    facts = {"aux_layer_ids": list(range(1, n_aux + 1)), "hidden_size": hidden, "target_fingerprint": "x"}
    if dtype == fs.FP8:
        facts["store_dtype"] = fs.FP8
    manifest = sw.open_for_writing(root, facts)
    g = torch.Generator().manual_seed(0)  # the same states in every store
    for spec in plan_shards(lengths, 262144):
        w = sw.ShardWriter(root, spec, facts, (n_aux * hidden, hidden), chunk, "blosc_lz4")
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
    help = "fp8_e4m3: the loader also decodes fp8 bits x scales to bf16"
    ap.add_argument("--store-dtype", default="bf16", choices=["bf16", fs.FP8], help=help)
    ap.add_argument("--repeats", type=int, default=5, help="timed passes per store (the median is kept)")
    a = ap.parse_args()
    torch.set_num_threads(1)  # one DataLoader worker
    drawn = np.random.default_rng(0).gamma(4.0, a.mean_len / 4.0, a.samples)
    lengths = np.clip(drawn, 16, 2048).astype(np.int64)
    packs = plan_packs(np.arange(a.samples), lengths, a.tokens_per_pack, seed=0, epoch=0)[: a.packs]
    T = a.tokens_per_pack
    used_tokens = sum(min(start + T, int(lengths[i]) - 1) - start for pack in packs for i, start, _ in pack)
    row_bytes = (a.n_aux + 1) * a.hidden * 2
    name = "loader_read" + ("" if a.store_dtype == "bf16" else "_fp8")
    res = bench_json.header(name, torch=torch.__version__, store_dtype=a.store_dtype, hidden=a.hidden)
    res |= {"states": "synthetic heavy-tailed bf16", "n_aux": a.n_aux, "samples": a.samples}
    res["repeats"] = a.repeats
    res |= {"mean_sample_tokens": float(lengths.mean()), "tokens_per_pack": a.tokens_per_pack}
    res |= {"packs_timed": len(packs), "tokens_read": int(used_tokens), "per_chunk_tokens": {}}
    chunks = [int(c) for c in a.chunks.split(",")]
    roots = {c: Path(tempfile.mkdtemp(prefix=f"loader_read_{c}_")) for c in chunks}
    try:
        sizes = {c: write_store(roots[c], lengths, a, c) for c in chunks}
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
        chunks_read = [(offsets[i + 1] - 1) // c - offsets[i] // c + 1 for pack in packs for i, _, _ in pack]
        decoded = sum(chunks_read) * c
        s = float(np.median(times[c]))
        r = {"store_bytes": sizes[c], "store_bytes_per_token": sizes[c] / lengths.sum(), "seconds_median": s}
        r |= {"seconds_all": times[c], "tokens_per_s": used_tokens / s}
        r["state_MB_per_s"] = used_tokens * row_bytes / s / 1e6
        r["decode_amplification"] = decoded / used_tokens  # approximate: chunks restart at shard edges
        res["per_chunk_tokens"][str(c)] = r
        print(f"chunk {c}:", {k: round(v, 2) for k, v in r.items() if k != "seconds_all"}, flush=True)
    print("->", bench_json.write(res, f"{name}_cpu", Path(__file__).parent / "results"))


if __name__ == "__main__":
    main()
