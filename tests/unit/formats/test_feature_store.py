import json

import numpy as np
import pytest
import torch

from pipeline.formats import feature_store as fs

FACTS = {"aux_layer_ids": [1, 2], "hidden_size": 4, "target_fingerprint": "abc"}


def _write(root, lengths, compressor="blosc_zstd", seed=0, facts=FACTS):
    g = torch.Generator().manual_seed(seed)
    manifest = fs.open_for_writing(root, facts)
    writer = fs.ShardWriter(root, fs.ShardSpec(0, 0, lengths), facts, (8, 4), chunk_tokens=3, compressor=compressor)
    data = []
    for i, n in enumerate(lengths):
        s = dict(input_ids=np.arange(n) + i, loss_mask=np.arange(n) % 2,
                 aux_hidden=torch.randn(n, 8, generator=g).bfloat16(), last_hidden=torch.randn(n, 4, generator=g).bfloat16())
        writer.write(i, **s)
        data.append(s)
    writer.commit(manifest)
    return data


def test_every_bf16_bit_pattern_round_trips_exactly():
    bits = np.arange(65536, dtype=np.uint16)  # NaNs, infinities, -0, subnormals included
    t = fs.bits_to_bf16(bits)
    assert t.dtype == torch.bfloat16
    assert np.array_equal(fs.bf16_to_bits(t), bits)


@pytest.mark.parametrize("compressor", ["blosc_zstd", "blosc_lz4", "none"])
def test_zarr_round_trip_is_bit_exact(tmp_path, compressor):
    data = _write(tmp_path, [5, 1, 7], compressor)
    store = fs.FeatureStore(tmp_path)
    assert len(store) == 3 and store.sample_lengths().tolist() == [5, 1, 7]
    for i, s in enumerate(data):
        got = store.sample(i)
        assert torch.equal(got["aux_hidden"].view(torch.int16), s["aux_hidden"].view(torch.int16))
        assert torch.equal(got["last_hidden"].view(torch.int16), s["last_hidden"].view(torch.int16))
        assert got["input_ids"].tolist() == s["input_ids"].tolist()
        assert got["loss_mask"].tolist() == s["loss_mask"].tolist()


def test_token_ranges_cover_the_store_in_order(tmp_path):
    data = _write(tmp_path, [5, 1, 7])
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
        fs.open_for_writing(tmp_path, {**FACTS, "aux_layer_ids": [1, 3]})
    fs.open_for_writing(tmp_path, {**FACTS, "aux_layer_ids": [1, 3]}, overwrite=True)
    assert json.loads((tmp_path / "manifest.json").read_text())["shards"] == []


def test_uncommitted_shards_are_invisible_and_cleaned(tmp_path):
    manifest = fs.open_for_writing(tmp_path, FACTS)
    writer = fs.ShardWriter(tmp_path, fs.ShardSpec(0, 0, [2]), FACTS, (8, 4))
    writer.write(0, np.arange(2), np.ones(2), torch.zeros(2, 8).bfloat16(), torch.zeros(2, 4).bfloat16())
    assert len(fs.FeatureStore(tmp_path)) == 0  # written, not committed
    (tmp_path / "shard-00001.zarr").mkdir()  # renamed but never entered in the manifest
    fs.open_for_writing(tmp_path, FACTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
    assert manifest["shards"] == []


def test_commit_refuses_a_shard_with_unwritten_samples(tmp_path):
    manifest = fs.open_for_writing(tmp_path, FACTS)
    writer = fs.ShardWriter(tmp_path, fs.ShardSpec(0, 0, [2, 2]), FACTS, (8, 4))
    writer.write(0, np.arange(2), np.ones(2), torch.zeros(2, 8).bfloat16(), torch.zeros(2, 4).bfloat16())
    with pytest.raises(RuntimeError, match="1 samples never written"):
        writer.commit(manifest)


def test_reader_rejects_an_unknown_schema(tmp_path):
    _write(tmp_path, [3])
    m = json.loads((tmp_path / "manifest.json").read_text())
    m["schema_version"] = 99
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(fs.StoreError, match="schema 99"):
        fs.FeatureStore(tmp_path)
