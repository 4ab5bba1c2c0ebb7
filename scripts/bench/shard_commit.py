"""Benchmark: what one shard's commit costs, by writer: zarr-python in this process, zarr-python in P writer processes
(extract.write_workers=P), tensorstore (extract.writer=tensorstore, C++ threads); issues #14 and #32 (the store
writer binds extract end to end on the H200, not the capture). --sync: the time includes os.sync() (durable bytes).

Synthetic bf16 states of a target's width (normal values: compress like real ones within a few %), one shard of
--tokens tokens, laid out as extract lays it (ShardWriter), committed to --root: by this process (write_workers=1),
then by P spawned writer processes from shared memory (extract.write_workers=P). Median of --reps commits each.
Usage:  python scripts/bench/shard_commit.py --hidden 576 --aux 3 --tokens 131072 --procs 1 2 4 --root /tmp/sc \
            --writers zarr tensorstore [--sync]
Writes shard_commit.json to $OUT (or the current folder) and prints a table.
"""

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
import zarr

import bench_json

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.formats import feature_store as fs  # noqa: E402

FACTS = {"aux_layer_ids": [1, 2, 3], "hidden_size": 0, "target_fingerprint": "bench"}


def one(root: Path, a, pool, aux: torch.Tensor, last: torch.Tensor, writer: str) -> float:
    shutil.rmtree(root, ignore_errors=True)
    manifest = fs.open_for_writing(root, {**FACTS, "hidden_size": a.hidden})
    lengths = [a.sample_tokens] * (a.tokens // a.sample_tokens)
    w = fs.ShardWriter(root, fs.ShardSpec(0, 0, lengths), FACTS, (a.aux * a.hidden, a.hidden), a.chunk_tokens,
                       a.compressor, shared=pool is not None, writer=writer)
    ids, mask = np.zeros(a.sample_tokens, np.int32), np.ones(a.sample_tokens, np.uint8)
    for i in range(len(lengths)):
        s = slice(i * a.sample_tokens, (i + 1) * a.sample_tokens)
        w.write(i, ids, mask, aux[s], last[s])
    t = time.perf_counter()
    w.commit(manifest, pool)
    if a.sync:
        os.sync()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--aux", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--sample-tokens", type=int, default=512)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--compressor", default="blosc_lz4")
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--writers", nargs="+", default=["zarr", "tensorstore"], choices=fs.WRITERS,
                    help="tensorstore runs in this process only (its threads): --procs applies to zarr")
    ap.add_argument("--sync", action="store_true", help="time the commit plus os.sync(): the bytes durable")
    ap.add_argument("--root", default="/tmp/shard_commit")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[None],
                    help="zarr's async.concurrency (chunks in flight in one process; zarr's default 10)")
    a = ap.parse_args()
    torch.manual_seed(0)
    aux = torch.randn(a.tokens, a.aux * a.hidden).bfloat16()
    last = torch.randn(a.tokens, a.hidden).bfloat16()
    root = Path(a.root)
    rows = []
    runs = [("zarr", p, c) for p in a.procs for c in a.concurrency] if "zarr" in a.writers else []
    runs += [("tensorstore", 1, None)] if "tensorstore" in a.writers else []
    for writer, p, conc in runs:
        zarr.config.set({"async.concurrency": conc or 10})
        pool = None
        if p > 1:
            pool = ProcessPoolExecutor(p, mp_context=multiprocessing.get_context("spawn"))
            [f.result() for f in [pool.submit(fs.shard_regions.ready) for _ in range(p)]]  # started, not timed
        try:
            times = [one(root, a, pool, aux, last, writer) for _ in range(a.reps)]
        finally:
            if pool is not None:
                pool.shutdown()
        size = sum(f.stat().st_size for f in (root / fs.shard_name(0)).rglob("*") if f.is_file())
        dt = statistics.median(times)
        rows.append({"writer": writer, "write_workers": p, "zarr_concurrency": conc or 10 if writer == "zarr" else None,
                     "chunk_tokens": a.chunk_tokens, "sync": a.sync, "commit_s": dt, "commit_s_all": times,
                     "tokens_per_s": a.tokens / dt, "shard_bytes": size, "mb_per_s": size / dt / 1e6})
        print(json.dumps(rows[-1]), flush=True)
    shutil.rmtree(root, ignore_errors=True)
    bench_json.write(bench_json.header(
        "shard_commit", torch=torch.__version__, root=str(root), rows=rows, sync=a.sync,
        shape={"hidden": a.hidden, "aux": a.aux, "tokens": a.tokens, "chunk_tokens": a.chunk_tokens,
               "compressor": a.compressor}), "shard_commit")
    print(f"{'writer':>11} {'write_workers':>13} {'concurrency':>11} {'chunk':>6} {'commit s':>9} {'tokens/s':>10} "
          f"{'MB/s':>7}")
    for r in rows:
        print(f"{r['writer']:>11} {r['write_workers']:>13} {r['zarr_concurrency'] or '-':>11} {r['chunk_tokens']:>6} "
              f"{r['commit_s']:>9.2f} "
              f"{r['tokens_per_s']:>10,.0f} {r['mb_per_s']:>7.0f}")


if __name__ == "__main__":
    main()
