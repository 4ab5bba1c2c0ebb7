import numpy as np
import pytest

from pipeline.capture.aux_layers import aux_layer_ids, default_aux_layers
from pipeline.capture.hf import plan_batches
from pipeline.capture.store import plan_shards
from pipeline.errors import UserError


def test_default_aux_layers_match_the_engines_defaults():
    # SGLang/vLLM capture before layers [2, L//2, L-3] by default = outputs of layers [1, L//2-1, L-4]
    assert default_aux_layers(30) == [1, 14, 26]
    assert default_aux_layers(61) == [1, 29, 57]
    assert aux_layer_ids(None, 30) == [1, 14, 26]


@pytest.mark.parametrize(
    "ids,msg",
    [
        ([1, 30], r"\[30\] outside \[0, 29\]"),
        ([-1, 2], r"\[-1\] outside"),
        ([3, 3, 4], r"\[3\] repeated"),
        ([], "empty"),
    ],
)
def test_bad_aux_layer_ids_are_rejected(ids, msg):
    with pytest.raises(UserError, match=msg):
        aux_layer_ids(ids, 30)


def test_shards_are_contiguous_and_bounded():
    lengths = np.array([5, 5, 5, 20, 1, 1])
    shards = plan_shards(lengths, 10)
    assert [(s.sample_start, s.sample_end) for s in shards] == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert all(sum(s.lengths) <= 10 or len(s.lengths) == 1 for s in shards)


def test_batches_cover_each_sample_once_within_the_token_budget():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, size=200).tolist()
    batches = plan_batches(lengths, 512, 16)
    assert sorted(i for b in batches for i in b) == list(range(200))
    for b in batches:
        assert len(b) <= 16 and (len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 512)
        assert lengths[b[0]] == max(lengths[i] for i in b)


def test_writer_processes_fall_back_to_this_process_where_dev_shm_cannot_hold_two_shards(monkeypatch, caplog):
    """Containers often cap /dev/shm at 64 MB: extract.write_workers > 1 then writes from this process and
    says
    why in the log (the shared buffers would die with SIGBUS, not with an error)."""
    from types import SimpleNamespace

    from pipeline.capture import store as extract
    from pipeline.formats import shard_regions

    ex = SimpleNamespace(write_workers=4, shard_tokens=262144)
    monkeypatch.setattr(shard_regions, "shm_free_bytes", lambda: 64 * 2**20)
    with caplog.at_level("WARNING"):
        assert extract._writer_processes(ex, (3 * 576, 576), fp8=False) is None
    assert (
        "extract.write_workers=4: /dev/shm has 0.1 GB free, two shards in flight on 1 rank(s) need 2.4 GB"
        in caplog.text
    )
    assert extract._writer_processes(SimpleNamespace(write_workers=1, shard_tokens=8), (8, 4), False) is None
    monkeypatch.setattr(shard_regions, "shm_free_bytes", lambda: 3 * 2**30)  # room for one rank, not for 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with caplog.at_level("WARNING"):
        assert extract._writer_processes(ex, (3 * 576, 576), fp8=False) is None
    assert "two shards in flight on 8 rank(s) need 19.3 GB" in caplog.text


def test_a_shard_writer_falls_back_to_its_own_buffers_when_dev_shm_fills_after_the_check(
    monkeypatch, tmp_path
):
    """The room check is made once; another process may take /dev/shm later. The shared buffers are reserved
    when
    made (posix_fallocate), so that is an OSError there, and the shard is written by this process instead."""
    from types import SimpleNamespace

    from pipeline.capture import store as extract
    from pipeline.formats import store_writer as sw

    real = sw.ShardWriter

    def no_room(*a, shared=False, **k):
        if shared:
            raise OSError(28, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(sw, "ShardWriter", no_room)
    cfg = SimpleNamespace(
        run_dir=str(tmp_path),
        extract=SimpleNamespace(chunk_tokens=3, compressor="blosc_lz4", clevel=3, writer="zarr"),
    )
    monkeypatch.setattr(extract, "out_dir", lambda cfg: tmp_path)
    w = extract._shard_writer(cfg, sw.ShardSpec(0, 0, [2]), {"hidden_size": 4}, (8, 4), shared=True)
    assert isinstance(w, real) and w.shared is None
