import json

import numpy as np
import pytest
import torch

from pipeline.formats import feature_store as fs
from pipeline.formats import shard_regions, store_check
from pipeline.formats import store_writer as sw

FACTS = {"aux_layer_ids": [1, 2], "hidden_size": 4, "target_fingerprint": "abc"}


def _write(root, lengths, compressor="blosc_zstd", seed=0, facts=FACTS, pool=None):
    g = torch.Generator().manual_seed(seed)
    manifest = sw.open_for_writing(root, facts)
    writer = sw.ShardWriter(
        root,
        sw.ShardSpec(0, 0, lengths),
        facts,
        (8, 4),
        chunk_tokens=3,
        compressor=compressor,
        shared=pool is not None,
    )
    data = []
    for i, n in enumerate(lengths):
        s = dict(
            input_ids=np.arange(n) + i,
            loss_mask=np.arange(n) % 2,
            aux_hidden=torch.randn(n, 8, generator=g).bfloat16(),
            last_hidden=torch.randn(n, 4, generator=g).bfloat16(),
        )
        if facts.get("store_dtype") == fs.FP8:
            (a, sa), (b, sb) = (
                fs.encode_fp8(s["aux_hidden"].float(), 2),
                fs.encode_fp8(s["last_hidden"].float(), 1),
            )
            writer.write(i, s["input_ids"], s["loss_mask"], a, b, (sa, sb))
        else:
            writer.write(i, **s)
        data.append(s)
    segments = list(writer.shared.segments.values()) if writer.shared else []
    writer.commit(manifest, pool)
    return data, segments


def test_every_bf16_bit_pattern_round_trips_exactly():
    bits = np.arange(65536, dtype=np.uint16)  # NaNs, infinities, -0, subnormals included
    t = fs.bits_to_bf16(bits)
    assert t.dtype == torch.bfloat16
    assert np.array_equal(fs.bf16_to_bits(t), bits)


@pytest.mark.parametrize("compressor", ["blosc_zstd", "blosc_lz4", "none"])
def test_zarr_round_trip_is_bit_exact(tmp_path, compressor):
    data, _ = _write(tmp_path, [5, 1, 7], compressor)
    store = fs.FeatureStore(tmp_path)
    assert len(store) == 3 and store.sample_lengths().tolist() == [5, 1, 7]
    for i, s in enumerate(data):
        got = store.sample(i)
        assert torch.equal(got["aux_hidden"].view(torch.int16), s["aux_hidden"].view(torch.int16))
        assert torch.equal(got["last_hidden"].view(torch.int16), s["last_hidden"].view(torch.int16))
        assert got["input_ids"].tolist() == s["input_ids"].tolist()
        assert got["loss_mask"].tolist() == s["loss_mask"].tolist()


def test_token_ranges_cover_the_store_in_order(tmp_path):
    data, _ = _write(tmp_path, [5, 1, 7])
    ranges = list(fs.FeatureStore(tmp_path).iter_token_ranges(4))
    assert [a for _, a, _ in ranges] == [0, 4, 8, 12]
    ids = torch.cat([r["input_ids"] for _, _, r in ranges]).tolist()
    assert ids == [x for s in data for x in s["input_ids"].tolist()]


def test_arrays_record_bf16_as_logical_dtype(tmp_path):
    import zarr

    _write(tmp_path, [3])
    g = zarr.open_group(str(tmp_path / "shard-00000.zarr"), mode="r")
    assert g["aux_hidden"].dtype == np.uint16 and g["aux_hidden"].attrs["logical_dtype"] == "bfloat16"
    assert g.attrs["aux_layer_ids"] == [1, 2] and g.attrs["sample_range"] == [0, 1]


def test_store_refuses_features_from_other_facts(tmp_path):
    _write(tmp_path, [3])
    with pytest.raises(fs.StoreError, match="aux_layer_ids"):
        sw.open_for_writing(tmp_path, {**FACTS, "aux_layer_ids": [1, 3]})
    sw.open_for_writing(tmp_path, {**FACTS, "aux_layer_ids": [1, 3]}, overwrite=True)
    assert json.loads((tmp_path / "manifest.json").read_text())["shards"] == []


def test_uncommitted_shards_are_invisible_and_cleaned(tmp_path):
    manifest = sw.open_for_writing(tmp_path, FACTS)
    writer = sw.ShardWriter(tmp_path, sw.ShardSpec(0, 0, [2]), FACTS, (8, 4), chunk_tokens=2)
    writer.write(0, np.arange(2), np.ones(2), torch.zeros(2, 8).bfloat16(), torch.zeros(2, 4).bfloat16())
    assert len(fs.FeatureStore(tmp_path)) == 0  # written, not committed
    (tmp_path / "shard-00001.zarr").mkdir()  # renamed but never entered in the manifest
    sw.open_for_writing(tmp_path, FACTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
    assert manifest["shards"] == []


def test_commit_refuses_a_shard_with_unwritten_samples(tmp_path):
    manifest = sw.open_for_writing(tmp_path, FACTS)
    writer = sw.ShardWriter(tmp_path, sw.ShardSpec(0, 0, [2, 2]), FACTS, (8, 4), chunk_tokens=2)
    writer.write(0, np.arange(2), np.ones(2), torch.zeros(2, 8).bfloat16(), torch.zeros(2, 4).bfloat16())
    with pytest.raises(RuntimeError, match="1 samples never written"):
        writer.commit(manifest)


def _write_with_schema(root, version: int) -> None:
    """A one-sample store whose manifest then claims another schema version."""
    _write(root, [3])
    m = json.loads((root / "manifest.json").read_text())
    m["schema_version"] = version
    (root / "manifest.json").write_text(json.dumps(m))


def test_reader_rejects_an_unknown_schema(tmp_path):
    _write_with_schema(tmp_path, 99)
    with pytest.raises(fs.StoreError, match="schema 99"):
        fs.FeatureStore(tmp_path)


# ---- checksums (#12 B4, B5): every chunk carries a crc32c; a damaged one is found, never read as data
def _flip(path, at=-8):
    b = bytearray(path.read_bytes())
    b[at] ^= 0xFF
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("compressor", ["blosc_zstd", "none"])
def test_a_flipped_byte_in_a_chunk_stops_the_reader_naming_shard_and_array(tmp_path, compressor):
    _write(tmp_path, [5, 1, 7], compressor)
    _flip(tmp_path / "shard-00000.zarr/aux_hidden/c/0/0")
    store = fs.FeatureStore(tmp_path)
    with pytest.raises(
        fs.ChunkError,
        match=r"shard-00000.zarr/aux_hidden: chunk 0 fails its crc32c check.*"
        r"extract.repair=true",
    ):
        store.sample(0)
    assert store.sample(2)["aux_hidden"].shape == (7, 8)  # other chunks still read


def test_a_truncated_chunk_stops_the_reader(tmp_path):
    _write(tmp_path, [5, 1, 7])
    path = tmp_path / "shard-00000.zarr/last_hidden/c/1/0"
    path.write_bytes(path.read_bytes()[:7])
    with pytest.raises(fs.ChunkError, match="last_hidden: chunk 1 fails"):
        fs.FeatureStore(tmp_path).sample(0)  # tokens 0..4 span chunks 0 and 1 (3 tokens each): 1 is named


def test_a_missing_chunk_file_is_damage_not_zeros(tmp_path):
    _write(tmp_path, [5, 1, 7])
    (tmp_path / "shard-00000.zarr/loss_mask/c/0").unlink()  # zarr would read a missing chunk as fill_value
    with pytest.raises(fs.ChunkError, match="loss_mask: 1 chunk file"):
        fs.FeatureStore(tmp_path).sample(2)


def test_all_zero_chunks_are_written_so_a_missing_one_is_detectable(tmp_path):
    g = torch.Generator().manual_seed(0)
    manifest = sw.open_for_writing(tmp_path, FACTS)
    writer = sw.ShardWriter(tmp_path, sw.ShardSpec(0, 0, [6]), FACTS, (8, 4), chunk_tokens=3)
    writer.write(
        0, np.zeros(6), np.zeros(6), torch.zeros(6, 8).bfloat16(), torch.randn(6, 4, generator=g).bfloat16()
    )
    writer.commit(manifest)
    assert store_check.verify_store(tmp_path) == []
    assert (tmp_path / "shard-00000.zarr/aux_hidden/c/1/0").is_file()  # states: chunk_tokens
    assert (tmp_path / "shard-00000.zarr/loss_mask/c/0").is_file()  # 1-D arrays: fs.ID_CHUNK_TOKENS


def test_verify_store_lists_every_bad_chunk_and_passes_a_good_store(tmp_path):
    _write(tmp_path, [5, 1, 7])
    assert store_check.verify_store(tmp_path) == []
    _flip(tmp_path / "shard-00000.zarr/aux_hidden/c/3/0")
    path = tmp_path / "shard-00000.zarr/input_ids/c/0"  # 1-D arrays: one chunk of up to fs.ID_CHUNK_TOKENS
    path.write_bytes(path.read_bytes()[:3])
    bad = {(b["array"], b["chunk"]) for b in store_check.verify_store(tmp_path)}
    assert bad == {("aux_hidden", 3), ("input_ids", 0)}


def test_the_manifest_records_the_checksum_scheme(tmp_path):
    _write(tmp_path, [3])
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["schema_version"] == 2 and m["checksum"] == "crc32c"


def test_a_store_from_before_checksums_is_refused_with_the_fix(tmp_path):
    _write_with_schema(tmp_path, 1)
    with pytest.raises(fs.StoreError, match="before chunk checksums.*extract.overwrite=true"):
        fs.FeatureStore(tmp_path)
    with pytest.raises(fs.StoreError, match="schema 1"):
        sw.open_for_writing(tmp_path, FACTS)  # never resumed into
    sw.open_for_writing(tmp_path, FACTS, overwrite=True)
    assert json.loads((tmp_path / "manifest.json").read_text())["schema_version"] == 2


# ------------------------------------------------------------------------------------------------ fp8 store
FP8_FACTS = {**FACTS, "store_dtype": fs.FP8}


def _heavy_tailed(n, width, seed=0):
    """States like a transformer's residual stream: most values small, a few channels 100x larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g)
    x[:, ::17] *= 100
    return x.bfloat16()


def test_fp8_round_trip_error_is_within_e4m3s_bound_per_token_and_per_element():
    x = _heavy_tailed(64, 3 * 96)
    bits, scale = fs.encode_fp8(x, 3)
    assert bits.dtype == torch.uint8 and bits.shape == x.shape and scale.shape == (64, 3)
    back = fs.decode_fp8(bits.numpy(), scale.numpy()).float()
    xf = x.float()
    # per token (and layer): the relative error of the vector is at most e4m3's rounding, 2^-4 (plus bf16's
    # 2^-9)
    per_token = (back - xf).reshape(64, 3, 96).norm(dim=-1) / xf.reshape(64, 3, 96).norm(dim=-1)
    assert float(per_token.max()) <= 2**-4 + 2**-9
    # per element: 2^-4 relative, or half e4m3's smallest subnormal step (2^-10 x scale) near zero
    step = scale.repeat_interleave(96, dim=1)
    assert bool(((back - xf).abs() <= (2**-4 + 2**-8) * xf.abs() + 2**-10 * step * 1.01).all())
    # and it is really lossy (a test of the bound, not of a no-op)
    assert float(per_token.max()) > 2**-9


def test_fp8_decode_is_torchs_float8_cast_times_the_scale_for_every_bit_pattern():
    """decode_fp8 gathers through a 256-entry table (3.5x faster than torch's cast on CPU); its values are
    the cast's:
    every e4m3 bit pattern, against scales from tiny to huge, rounded to bf16 the same way."""
    bits = np.tile(np.arange(256, dtype=np.uint8), (6, 2))  # 6 tokens x 2 layers x 256 patterns
    scale = np.array(
        [[1e-30, 1.0], [2**-10, 3.7], [0.5, 448.0], [1e3, 1e-3], [7.25, 1e20], [1.0, 1.0]], np.float32
    )
    got = fs.decode_fp8(bits, scale)
    want = (
        (
            torch.from_numpy(bits).view(torch.float8_e4m3fn).float().reshape(6, 2, 256)
            * torch.from_numpy(scale).unsqueeze(-1)
        )
        .reshape(6, -1)
        .bfloat16()
    )
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and int(nan.sum()) == 6 * 2 * 2  # 0x7f and 0xff, e4m3fn's NaNs
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_fp8_encoding_in_chunks_of_tokens_is_bit_identical_to_one_pass():
    """encode_fp8 bounds its fp32 working copy by encoding chunk_rows tokens at a time (the GPU memory of a
    large
    capture batch); every chunking gives the same bits and scales, including a last chunk that is short."""
    x = _heavy_tailed(37, 3 * 96, seed=1)
    bits, scale = fs.encode_fp8(x, 3, chunk_rows=37)
    for rows in (1, 5, 16):
        b, s = fs.encode_fp8(x, 3, chunk_rows=rows)
        assert torch.equal(b, bits) and torch.equal(s, scale), rows
    b, s = fs.encode_fp8(x, 3)  # the default chunking
    assert torch.equal(b, bits) and torch.equal(s, scale)


def test_an_fp8_shard_is_written_as_uint8_plus_scales_and_read_back_as_bf16(tmp_path):
    manifest = sw.open_for_writing(tmp_path, FP8_FACTS)
    writer = sw.ShardWriter(tmp_path, sw.ShardSpec(0, 0, [5, 7]), FP8_FACTS, (8, 4), chunk_tokens=3)
    want = []
    for i, n in enumerate([5, 7]):
        aux, last = _heavy_tailed(n, 8, seed=i), _heavy_tailed(n, 4, seed=10 + i)
        (ab, asc), (lb, lsc) = fs.encode_fp8(aux, 2), fs.encode_fp8(last, 1)
        with pytest.raises(TypeError, match="fp8 bits and scales"):
            writer.write(i, np.arange(n), np.ones(n), aux, last)  # bf16 states into an fp8 shard: refused
        writer.write(i, np.arange(n), np.ones(n), ab, lb, (asc, lsc))
        want.append((fs.decode_fp8(ab.numpy(), asc.numpy()), fs.decode_fp8(lb.numpy(), lsc.numpy())))
    writer.commit(manifest)
    import zarr

    g = zarr.open_group(str(tmp_path / "shard-00000.zarr"), mode="r")
    assert (
        g["aux_hidden"].dtype == np.uint8
        and g["aux_scale"].shape == (12, 2)
        and g["last_scale"].shape == (12, 1)
    )
    store = fs.FeatureStore(tmp_path)
    for i, (aux, last) in enumerate(want):
        got = store.sample(i)
        assert got["aux_hidden"].dtype == torch.bfloat16 and torch.equal(got["aux_hidden"], aux)
        assert torch.equal(got["last_hidden"], last)
    assert store_check.verify_store(tmp_path) == []
    scale_chunk = tmp_path / "shard-00000.zarr" / "aux_scale" / "c" / "1" / "0"
    scale_chunk.unlink()  # a missing scale chunk is damage like any other
    assert [b["array"] for b in store_check.verify_store(tmp_path)] == ["aux_scale"]


def test_an_fp8_store_is_not_a_bf16_store(tmp_path):
    _write(tmp_path, [3, 4])
    with pytest.raises(fs.StoreError, match="store_dtype: store=None asked='fp8_e4m3'"):
        sw.open_for_writing(tmp_path, FP8_FACTS)


def test_threads_committing_shards_at_once_lose_no_manifest_entry_even_where_flock_is_per_process(
    tmp_path, monkeypatch
):
    """extract.write_workers: shards of one process commit from several threads. On NFS, Linux maps flock to
    fcntl locks, which do not exclude threads of one process; simulated here at that boundary by a flock that
    excludes nothing (named: fake_nfs_flock), with a slow read so that unguarded read-modify-writes would
    overlap."""
    import threading
    import time

    sw.open_for_writing(tmp_path, FACTS)
    monkeypatch.setattr(fs.fcntl, "flock", lambda f, op: None)  # fake_nfs_flock: no exclusion between threads
    real_read = fs.read_manifest
    # add_shard (store_writer) reads the manifest through its own name for it
    monkeypatch.setattr(sw, "read_manifest", lambda root: (time.sleep(0.02), real_read(root))[1])
    entries = [
        {"name": fs.shard_name(i), "sample_start": i, "sample_end": i + 1, "num_tokens": 1} for i in range(8)
    ]
    threads = [threading.Thread(target=sw.add_shard, args=(tmp_path, e)) for e in entries]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [s["name"] for s in real_read(tmp_path)["shards"]] == [e["name"] for e in entries]


# ------------------------------------------------------------------------------- writer processes (#14)
def _files(root):
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != fs.LOCK
    }


@pytest.mark.parametrize("facts", [FACTS, FP8_FACTS], ids=["bf16", "fp8"])
def test_a_shard_written_by_writer_processes_is_byte_for_byte_this_process_shard(tmp_path, facts):
    """extract.write_workers > 1: the states live in shared memory and spawned processes encode and write
    chunk-aligned token ranges of them. Every file (chunks, metadata, manifest) equals the one-process
    shard's, and
    the shared memory is unlinked after the commit."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import shared_memory

    lengths = [5, 1, 7, 30, 2, 11]  # 56 tokens, chunk 3: 19 chunks over 2 processes in up to 32 ranges
    _write(tmp_path / "one", lengths, "blosc_lz4", facts=facts)

    class Counted:  # the pool as commit sees it, counting the ranges handed to the writer processes
        def __init__(self, pool):
            self.pool, self.ranges = pool, 0

        def submit(self, fn, *args):
            self.ranges += fn is shard_regions.write_region
            return self.pool.submit(fn, *args)

    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        pids = {f.result() for f in [pool.submit(shard_regions.ready) for _ in range(4)]}
        counted = Counted(pool)
        _, segments = _write(tmp_path / "procs", lengths, "blosc_lz4", facts=facts, pool=counted)
    assert os.getpid() not in pids and segments
    assert counted.ranges == 2 * 19  # aux and last: 19 chunks of 3 tokens each, one range per chunk (<= 32)
    assert _files(tmp_path / "procs") == _files(tmp_path / "one")
    for seg in segments:  # unlinked: attaching by name fails
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=seg.name)


def test_writer_regions_are_whole_chunks_that_cover_the_array_once():
    for total, chunk, pieces in [(56, 3, 32), (56, 3, 2), (7, 512, 4), (1024, 512, 8), (1025, 512, 1)]:
        r = shard_regions.regions(total, chunk, pieces)
        assert r[0][0] == 0 and r[-1][1] == total and len(r) <= pieces
        assert all(a % chunk == 0 and b > a for a, b in r) and all(
            r[i][1] == r[i + 1][0] for i in range(len(r) - 1)
        )


def test_commit_with_a_pool_refuses_a_writer_without_shared_buffers(tmp_path):
    manifest = sw.open_for_writing(tmp_path, FACTS)
    w = sw.ShardWriter(tmp_path, sw.ShardSpec(0, 0, [1]), FACTS, (8, 4), chunk_tokens=3)
    w.write(0, np.arange(1), np.ones(1), torch.zeros(1, 8).bfloat16(), torch.zeros(1, 4).bfloat16())
    with pytest.raises(ValueError, match="shared=True"):
        w.commit(manifest, pool=object())


def test_an_uncommitted_shared_writer_discards_its_shared_memory(tmp_path):
    """A shard that fails while it fills (capture error, the previous commit failing) must not leave up to 15
    GB
    in /dev/shm until the process ends: discard() unlinks it."""
    from multiprocessing import shared_memory

    w = sw.ShardWriter(tmp_path, sw.ShardSpec(0, 0, [4]), FACTS, (8, 4), chunk_tokens=3, shared=True)
    names = [seg.name for seg in w.shared.segments.values()]
    w.write(0, np.arange(4), np.ones(4), torch.zeros(4, 8).bfloat16(), torch.zeros(4, 4).bfloat16())
    w.discard()
    assert names and w.buffers == {}
    for name in names:
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=name)


def test_writer_processes_exit_when_their_extract_is_killed(tmp_path):
    """SIGKILL on extract must not leave its writer processes behind (they would hold the resource tracker,
    and
    with it every shared segment, alive): each one watches its parent (shard_regions.watch_parent)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "extract_like.py"
    script.write_text(
        "import multiprocessing, os, sys, time\n"
        "from concurrent.futures import ProcessPoolExecutor\n"
        "from pipeline.formats import shard_regions\n"
        "def pid():\n"
        "    time.sleep(1.0)\n"
        "    return os.getpid()\n"
        "if __name__ == '__main__':\n"
        "    pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context('spawn'),\n"
        "                               initializer=shard_regions.watch_parent)\n"
        "    pids = {f.result() for f in [pool.submit(pid) for _ in range(2)]}\n"
        "    print(' '.join(map(str, pids)), flush=True)\n"
        "    time.sleep(600)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
    )
    workers = [int(p) for p in proc.stdout.readline().split()]
    assert len(workers) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    alive = workers
    while alive and time.time() < deadline:
        time.sleep(0.2)
        alive = [
            p
            for p in workers
            if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]
        ]
    assert not alive, f"writer processes {alive} outlived their killed parent"
