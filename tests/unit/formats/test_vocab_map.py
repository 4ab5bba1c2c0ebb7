import numpy as np
import pytest
import torch

from pipeline.errors import UserError
from pipeline.formats import vocab_map
from pipeline.formats.vocab_map import VocabError, build, validate


def freq_of(counts: dict, V=20):
    f = np.zeros(V, dtype=np.int64)
    for i, c in counts.items():
        f[i] = c
    return f


def test_top_k_by_count_sorted_ascending_as_offsets():
    d2t, t2d, padded = build(freq_of({3: 10, 7: 50, 11: 5, 15: 40, 19: 1}), 3)
    used = (torch.arange(3) + d2t).tolist()
    assert used == [3, 7, 15] and padded == 0
    assert d2t.tolist() == [3, 6, 13] and t2d.nonzero().flatten().tolist() == [3, 7, 15]


def test_too_few_seen_ids_are_padded_with_lowest_unused_ids():
    d2t, t2d, padded = build(freq_of({9: 5, 4: 2}), 4)
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 4, 9] and padded == 2


def test_an_absolute_id_d2t_is_rejected():
    d2t, t2d, _ = build(freq_of({3: 10, 7: 50, 15: 40}), 3)
    absolute = torch.arange(3) + d2t  # the "fix" that turned offsets into target ids
    with pytest.raises(VocabError, match="absolute target ids"):
        validate(absolute, t2d, 20, 3)


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda d, t: (d[:2].clone(), t), "len\\(d2t\\)=2"),
        (lambda d, t: (d.flip(0).clone(), t), "strictly increasing"),
        (lambda d, t: (d + 10, t), "leaves \\[0, 20\\)"),
        (lambda d, t: (d, torch.ones_like(t)), "t2d.sum\\(\\)=20"),
        (lambda d, t: (d.int(), t), "int64"),
    ],
)
def test_broken_tables_are_rejected(mutate, msg):
    d2t, t2d, _ = build(freq_of({3: 10, 7: 50, 15: 40}), 3)
    with pytest.raises(VocabError, match=msg):
        validate(*mutate(d2t, t2d), 20, 3)


def test_save_load_round_trip_and_load_revalidates(tmp_path):
    f = freq_of({3: 10, 7: 50, 15: 40})
    d2t, t2d, _ = build(f, 3)
    vocab_map.save(tmp_path, d2t, t2d, f, {"features_manifest_hash": "x"})
    d, t, m = vocab_map.load(tmp_path)
    assert torch.equal(d, d2t) and torch.equal(t, t2d) and m["draft_vocab_size"] == 3
    from safetensors.torch import save_file

    save_file({"d2t": torch.arange(3) + d2t, "t2d": t2d}, str(tmp_path / "vocab.safetensors"))
    with pytest.raises(UserError, match=r"vocab.safetensors is damaged \(d2t holds absolute"):
        vocab_map.load(tmp_path)  # one line naming the file and the fix, not VocabError's traceback
