"""extract.writer=tensorstore (issue #32): the store it writes is the store zarr-python writes, byte for
byte, read by plain zarr, resumable after a kill -9 in the middle of a shard, its damage caught by
verify_store
(check-store)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from pipeline.formats import feature_store as fs
from pipeline.formats import store_check
from pipeline.formats import store_writer as sw

FACTS = {"aux_layer_ids": [1, 2], "hidden_size": 4, "target_fingerprint": "abc"}
FP8_FACTS = {**FACTS, "store_dtype": fs.FP8}
ROOT = Path(__file__).resolve().parents[3]


def write_store(root, shards, writer, facts=FACTS, compressor="blosc_lz4", chunk_tokens=3):
    """`shards`: per shard, its sample lengths; the samples' values depend on (shard, sample) only."""
    manifest = sw.open_for_writing(root, facts)
    start = 0
    for index, lengths in enumerate(shards):
        if any(s["name"] == fs.shard_name(index) for s in manifest["shards"]):
            start += len(lengths)
            continue
        w = sw.ShardWriter(
            root,
            sw.ShardSpec(index, start, lengths),
            facts,
            (8, 4),
            chunk_tokens=chunk_tokens,
            compressor=compressor,
            writer=writer,
        )
        for i, n in enumerate(lengths):
            g = torch.Generator().manual_seed(1000 * index + i)
            aux, last = torch.randn(n, 8, generator=g).bfloat16(), torch.randn(n, 4, generator=g).bfloat16()
            if i == 0:
                aux[:], last[:] = 0, 0  # an all-zero chunk: written, never left out as "fill value"
            ids, mask = np.arange(n) + 7 * i, np.arange(n) % 2
            if facts.get("store_dtype") == fs.FP8:
                (a, sa), (b, sb) = fs.encode_fp8(aux.float(), 2), fs.encode_fp8(last.float(), 1)
                w.write(i, ids, mask, a, b, (sa, sb))
            else:
                w.write(i, ids, mask, aux, last)
        w.commit(manifest)
        start += len(lengths)
    return manifest


def files(root):
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(Path(root).rglob("*"))
        if p.is_file() and p.name != fs.LOCK
    }


SHARDS = [[4, 5, 3], [7, 2], [6, 6, 1]]


@pytest.mark.parametrize("facts", [FACTS, FP8_FACTS], ids=["bf16", "fp8"])
@pytest.mark.parametrize("compressor", ["blosc_lz4", "blosc_zstd", "none"])
def test_tensorstore_writes_the_same_bytes_as_zarr_python(tmp_path, facts, compressor):
    write_store(tmp_path / "zarr", SHARDS, "zarr", facts, compressor)
    write_store(tmp_path / "ts", SHARDS, "tensorstore", facts, compressor)
    a, b = files(tmp_path / "zarr"), files(tmp_path / "ts")
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == []
    ra, rb = fs.FeatureStore(tmp_path / "zarr"), fs.FeatureStore(tmp_path / "ts")
    for i in range(len(ra)):
        sa, sb = ra.sample(i), rb.sample(i)
        assert all(
            torch.equal(
                sa[k].view(torch.int16) if sa[k].dtype == torch.bfloat16 else sa[k],
                sb[k].view(torch.int16) if sb[k].dtype == torch.bfloat16 else sb[k],
            )
            for k in sa
        )


def test_plain_zarr_reads_a_tensorstore_shard(tmp_path):
    write_store(tmp_path, SHARDS, "tensorstore")
    group = zarr.open_group(str(tmp_path / fs.shard_name(1)), mode="r")
    offsets = group["offsets"][...]
    assert offsets.tolist() == [0, 7, 9]
    assert group["input_ids"][...].tolist() == list(range(7)) + [7, 8]
    assert group["aux_hidden"].attrs["logical_dtype"] == "bfloat16"
    assert group["aux_hidden"].shape == (9, 8)
    g = torch.Generator().manual_seed(1000 * 1 + 1)
    aux = torch.randn(2, 8, generator=g).bfloat16()
    assert np.array_equal(group["aux_hidden"][7:9], fs.bf16_to_bits(aux))


def test_a_flipped_byte_in_a_tensorstore_chunk_is_found_by_verify_store(tmp_path):
    write_store(tmp_path, SHARDS, "tensorstore")
    assert store_check.verify_store(tmp_path) == []
    chunk = tmp_path / fs.shard_name(2) / "aux_hidden" / "c" / "1" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    bad = store_check.verify_store(tmp_path)
    assert [(b["shard"], b["array"], b["chunk"]) for b in bad] == [(fs.shard_name(2), "aux_hidden", 1)]


KILLED = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from pipeline.formats import store_writer as sw
import test_store_writer as t

real = sw.write_with_tensorstore
def half_then_stall(group_dir, buffers):
    names = list(buffers)
    real(group_dir, {{n: buffers[n] for n in names[: len(names) // 2 + 1]}})  # some arrays' chunks on disk
    Path({marker!r}).touch()
    time.sleep(120)  # killed here, the shard half written
sw.write_with_tensorstore = half_then_stall
t.write_store(Path({root!r}), t.SHARDS, "tensorstore")
"""


def test_kill_9_in_the_middle_of_a_tensorstore_shard_resumes_to_the_same_bytes(tmp_path):
    whole = tmp_path / "whole"
    write_store(whole, SHARDS, "tensorstore")
    root, marker = tmp_path / "killed", tmp_path / "half-written"
    code = KILLED.format(tests=str(Path(__file__).parent), marker=str(marker), root=str(root))
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    try:
        for _ in range(600):
            if marker.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert marker.exists(), f"the writer never reached the middle of shard 0 (exit {proc.poll()})"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    tmp = root / (fs.shard_name(0) + ".tmp")
    assert any((tmp / "input_ids" / "c").rglob("*")), "the kill came before any chunk was written"
    assert fs.read_manifest(root)["shards"] == []  # nothing half-written is visible
    write_store(root, SHARDS, "tensorstore")  # the same command again
    assert files(root) == files(whole)
