"""Benchmark: what a filesystem takes in plain Python writes, by file size and writer threads (issue #14: extract on
the H200 is bound by its store writer, 467 MB/s into /tmp whatever the process count, while `dd oflag=direct` wrote
1.3 GB/s; 512-token chunks were slower there than 2,048-token ones).

The same bytes as zarr's chunk files would be (--total-mb, random: incompressible), written as files of each
--file-kb (1,770 KB = a 512-token chunk of SmolLM2's 3 aux layers, 590 KB = one of its last layer; 65,536 KB = a
few large files) by each count of --threads (file writes release the GIL), without fsync; then the same with one
os.sync() at the end timed in. If small files are much slower than large ones, the per-file cost (creation,
metadata: an overlay filesystem's) binds the store and fewer chunk files (zarr sharding, longer chunks) is the
lever; if every row sits near zarr's rate, it is the bandwidth.
Usage:  python scripts/bench/disk_write.py --root /tmp/dw [--total-mb 2048] [--file-kb 590 1770 65536] [--threads 1 4 16]
Writes disk_write.json to $OUT (or the current folder) and prints a table.
"""

import argparse
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import bench_json


def write_files(root: Path, total: int, file_bytes: int, threads: int, buf: memoryview, sync: bool) -> float:
    shutil.rmtree(root, ignore_errors=True)
    (root / "c").mkdir(parents=True)
    n = max(1, total // file_bytes)

    def one(i: int) -> None:
        with open(root / "c" / str(i), "wb") as f:
            f.write(buf[(i * 4096) % (len(buf) - file_bytes + 1):][:file_bytes])

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(n)))
    if sync:
        os.sync()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/tmp/disk_write")
    ap.add_argument("--total-mb", type=int, default=2048)
    ap.add_argument("--file-kb", type=int, nargs="+", default=[590, 1770, 65536])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 16])
    a = ap.parse_args()
    total, root = a.total_mb << 20, Path(a.root)
    buf = memoryview(os.urandom(max(a.file_kb) * 1024 + (64 << 20)))
    rows = []
    for sync in (False, True):
        for kb in a.file_kb:
            for th in a.threads:
                dt = write_files(root, total, kb * 1024, th, buf, sync)
                rows.append({"file_kb": kb, "threads": th, "sync_at_end": sync, "files": max(1, total // (kb * 1024)),
                             "seconds": dt, "mb_per_s": total / dt / 1e6})
                print(json.dumps(rows[-1]), flush=True)
    shutil.rmtree(root, ignore_errors=True)
    bench_json.write(bench_json.header("disk_write", root=str(root), total_mb=a.total_mb, rows=rows), "disk_write")
    print(f"{'file KB':>8} {'threads':>7} {'sync':>5} {'files':>6} {'MB/s':>7}")
    for r in rows:
        print(f"{r['file_kb']:>8} {r['threads']:>7} {r['sync_at_end']!s:>5} {r['files']:>6} {r['mb_per_s']:>7.0f}")


if __name__ == "__main__":
    main()
