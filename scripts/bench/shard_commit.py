"""Benchmark (issues #14, #32): what one shard's commit costs, by writer: zarr-python in this process or in
P writer processes (extract.write_workers=P), tensorstore (extract.writer=tensorstore, C++ threads). One
shard of synthetic bf16 states of a target's width, laid out as extract lays it (ShardWriter), committed to
--root; median of --reps commits. --sync: the time includes os.sync() (durable bytes).
Usage:  python scripts/bench/shard_commit.py --hidden 576 --aux 3 --tokens 131072 --procs 1 2 4 \
            --root /tmp/sc --writers zarr tensorstore [--sync] [--name writer_tmp]
Writes NAME.json (--name; bench_json: $OUT, else the current folder); prints a JSON line per row.
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

import bench_json
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.formats import feature_store as fs  # noqa: E402
from pipeline.formats import shard_regions  # noqa: E402
from pipeline.formats import store_writer as sw  # noqa: E402

FACTS = {"aux_layer_ids": [1, 2, 3], "hidden_size": 0, "target_fingerprint": "bench"}


def one(root: Path, a, pool, aux: torch.Tensor, last: torch.Tensor, writer: str) -> float:
    shutil.rmtree(root, ignore_errors=True)
    manifest = sw.open_for_writing(root, {**FACTS, "hidden_size": a.hidden})
    lengths = [a.sample_tokens] * (a.tokens // a.sample_tokens)
    widths, spec = (a.aux * a.hidden, a.hidden), sw.ShardSpec(0, 0, lengths)
    kw = {"shared": pool is not None, "writer": writer}
    w = sw.ShardWriter(root, spec, FACTS, widths, a.chunk_tokens, a.compressor, **kw)
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
    help = "tensorstore runs in this process only (its threads): --procs applies to zarr"
    ap.add_argument("--writers", nargs="+", default=["zarr", "tensorstore"], choices=sw.WRITERS, help=help)
    ap.add_argument("--sync", action="store_true", help="time the commit plus os.sync(): the bytes durable")
    ap.add_argument("--root", default="/tmp/shard_commit")
    ap.add_argument("--name", default="shard_commit", help="the JSON's name (one per --root in a plan)")
    a = ap.parse_args()
    torch.manual_seed(0)
    aux = torch.randn(a.tokens, a.aux * a.hidden).bfloat16()
    last = torch.randn(a.tokens, a.hidden).bfloat16()
    root = Path(a.root)
    rows = []
    runs = [("zarr", p) for p in a.procs] if "zarr" in a.writers else []
    runs += [("tensorstore", 1)] if "tensorstore" in a.writers else []
    for writer, p in runs:
        pool = None
        if p > 1:
            pool = ProcessPoolExecutor(p, mp_context=multiprocessing.get_context("spawn"))
            [f.result() for f in [pool.submit(shard_regions.ready) for _ in range(p)]]  # started, not timed
        try:
            times = [one(root, a, pool, aux, last, writer) for _ in range(a.reps)]
        finally:
            if pool is not None:
                pool.shutdown()
        size = sum(f.stat().st_size for f in (root / fs.shard_name(0)).rglob("*") if f.is_file())
        dt = statistics.median(times)
        row = {"writer": writer, "write_workers": p, "sync": a.sync, "commit_s": dt, "commit_s_all": times}
        rows.append(row | {"tokens_per_s": a.tokens / dt, "shard_bytes": size, "mb_per_s": size / dt / 1e6})
        print(json.dumps(rows[-1]), flush=True)
    shutil.rmtree(root, ignore_errors=True)
    shape = {"hidden": a.hidden, "aux": a.aux, "tokens": a.tokens, "chunk_tokens": a.chunk_tokens}
    res = bench_json.header(a.name, torch=torch.__version__, root=str(root), sync=a.sync, rows=rows)
    bench_json.write(res | {"shape": shape | {"compressor": a.compressor}}, a.name)


if __name__ == "__main__":
    main()
