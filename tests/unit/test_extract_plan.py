import numpy as np
import pytest

from pipeline.errors import UserError
from pipeline.engines.hf_capture import aux_layer_ids, default_aux_layers
from pipeline.stages.extract import plan_batches, plan_shards


def test_default_aux_layers_match_the_engines_defaults():
    # SGLang/vLLM capture before layers [2, L//2, L-3] by default = outputs of layers [1, L//2-1, L-4]
    assert default_aux_layers(30) == [1, 14, 26]
    assert default_aux_layers(61) == [1, 29, 57]
    assert aux_layer_ids(None, 30) == [1, 14, 26]


@pytest.mark.parametrize("ids,msg", [([1, 30], r"\[30\] outside \[0, 29\]"), ([-1, 2], r"\[-1\] outside"),
                                     ([3, 3, 4], r"\[3\] repeated"), ([], "empty")])
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
