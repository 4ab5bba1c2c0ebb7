"""The draft-vocabulary coverage table (pipeline/formats/vocab_map.py): what the vocab stage reports at each
compared size, so the size is chosen by measurement (issue #37)."""

import numpy as np
import pytest

from pipeline.formats import vocab_map


def test_coverage_by_size_counts_the_most_supervised_ids_first():
    freq = np.array([50, 0, 20, 30, 0])  # 100 supervised tokens over three ids
    assert vocab_map.coverage_by_size(freq, [1, 2, 3, 5, 8]) == {1: 0.5, 2: 0.8, 3: 1.0, 5: 1.0, 8: 1.0}


@pytest.mark.parametrize("share,ids", [(0.5, 1), (0.51, 2), (0.8, 2), (0.99, 3), (1.0, 3)])
def test_smallest_covering_is_the_fewest_ids_that_reach_the_share(share, ids):
    assert vocab_map.smallest_covering(np.array([50, 0, 20, 30, 0]), share) == ids


def test_heldout_coverage_ranks_ids_on_the_other_samples_and_measures_on_the_held_ones():
    fit = np.array([9, 5, 0, 1])  # id 0, then 1, then 3 are the most counted where the vocabulary is chosen
    held = np.array([1, 0, 2, 1])  # the held-out samples use id 2, never seen in `fit`
    assert vocab_map.heldout_coverage_by_size(fit, held, [1, 2, 3, 4]) == {1: 0.25, 2: 0.25, 3: 0.5, 4: 1.0}
    in_sample = vocab_map.coverage_by_size(fit + held, [2])[2]
    assert in_sample > vocab_map.heldout_coverage_by_size(fit, held, [2])[2]  # what in-sample overstates
