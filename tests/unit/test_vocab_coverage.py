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
