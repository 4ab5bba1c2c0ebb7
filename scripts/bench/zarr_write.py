"""Benchmark: zarr's own write rate for one shard's aux-state array, by layout and codec (issue #14: is it zarr, the
codec or the chunk files that bind the store writer?).

One array of --tokens x (3 x --hidden) bf16 bits (normal values, as shard_commit.py), written in one assignment as
ShardWriter writes it, in this process, to --root, for each layout: chunks of 512 and 2,048 tokens (one file
each), and zarr v3 sharding (512-token chunks inside one file per 16,384 tokens, or one file for the array);
and for each codec chain: none, crc32c, lz4 + bit-shuffle, lz4 + bit-shuffle + crc32c (the store's). Then the
time to read 200 random 450-token row ranges (a training sample) from each layout.
Usage:  python scripts/bench/zarr_write.py --root /dev/shm/zw [--tokens 131072] [--hidden 576]
Writes zarr_write.json to $OUT (or the current folder) and prints a table.
"""

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import BloscCodec, BloscShuffle, Crc32cCodec

import bench_json


def codecs(name: str):
    lz4 = BloscCodec(cname="lz4", clevel=3, shuffle=BloscShuffle.bitshuffle)
    return {"none": None, "crc32c": [Crc32cCodec()], "lz4": [lz4], "lz4+crc32c": [lz4, Crc32cCodec()]}[name]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/tmp/zarr_write")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--reads", type=int, default=200)
    a = ap.parse_args()
    T, W = a.tokens, 3 * a.hidden
    x = (np.random.default_rng(0).standard_normal((T, W), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    layouts = {"chunks 512": ((512, W), None), "chunks 2048": ((2048, W), None),
               "512 in 16K-token files": ((512, W), (16384, W)), "512 in one file": ((512, W), (T, W))}
    root, rows = Path(a.root), []
    for codec in ("none", "crc32c", "lz4", "lz4+crc32c"):
        for name, (chunks, shards) in layouts.items():
            if codec != "lz4+crc32c" and name != "chunks 512":
                continue  # the codec rows on the store's layout; the layout rows with the store's codecs
            path = root / "a"
            shutil.rmtree(root, ignore_errors=True)
            arr = zarr.open_group(str(path), mode="w", zarr_format=3).create_array(
                "aux", shape=x.shape, chunks=chunks, shards=shards, dtype=np.uint16, compressors=codecs(codec), fill_value=0)
            t = time.perf_counter()
            arr[...] = x
            dt = time.perf_counter() - t
            files = sum(len(f) for _, _, f in os.walk(path))
            rng, t = np.random.default_rng(1), time.perf_counter()
            for _ in range(a.reads):
                s = int(rng.integers(0, T - 450))
                arr[s:s + 450]
            rd = (time.perf_counter() - t) / a.reads
            rows.append({"layout": name, "codecs": codec, "write_s": dt, "mb_per_s": x.nbytes / dt / 1e6, "files": files,
                         "read_450_ms": rd * 1e3})
            print(json.dumps(rows[-1]), flush=True)
    shutil.rmtree(root, ignore_errors=True)
    bench_json.write(bench_json.header("zarr_write", zarr=zarr.__version__, root=str(root), rows=rows,
                                       array={"tokens": T, "width": W, "bytes": int(x.nbytes)}), "zarr_write")
    print(f"{'layout':>24} {'codecs':>11} {'MB/s':>7} {'files':>6} {'read 450 ms':>12}")
    for r in rows:
        print(f"{r['layout']:>24} {r['codecs']:>11} {r['mb_per_s']:>7.0f} {r['files']:>6} {r['read_450_ms']:>12.2f}")


if __name__ == "__main__":
    main()
