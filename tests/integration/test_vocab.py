import json

import numpy as np
import pytest
import torch

from pipeline.errors import UserError
from pipeline.formats.feature_store import FeatureStore
from pipeline.runner import run_stages
from pipeline.training.setup import load_inputs

pytestmark = pytest.mark.slow


def test_vocab_counts_supervised_tokens_of_the_store(make_cfg, tmp_path):
    cfg = make_cfg("+experiment=tiny", "data.limit=8", run_dir=tmp_path)
    run_stages(cfg)
    store = FeatureStore(tmp_path / "features")
    counts = np.zeros(1024, dtype=np.int64)
    for i in range(len(store)):
        s = store.sample(i)
        np.add.at(counts, s["input_ids"][s["loss_mask"].bool()].numpy(), 1)
    _, d2t, t2d, manifest = load_inputs(cfg)  # the loader train uses: vocab checked against the store
    used = torch.arange(len(d2t)) + d2t
    assert manifest["draft_vocab_size"] == 256 == len(d2t)
    kept = counts[used.numpy()]
    dropped = np.delete(counts, used.numpy())
    assert kept.min() >= dropped.max()  # nothing left out counts more than anything kept
    report = json.loads((tmp_path / "vocab" / "report.json").read_text())
    assert report["supervised_tokens"] == counts.sum()
    assert report["coverage"] == pytest.approx(kept.sum() / counts.sum())
    # the table for choosing another size: tiny's vocabulary is 1,024 ids, so the compared sizes are its own
    # draft size and the full vocabulary
    assert report["coverage_by_size"] == {"256": pytest.approx(report["coverage"]), "1024": 1.0}
    top = np.sort(counts)[::-1].cumsum()
    assert report["ids_for_coverage"]["0.99"] == int(np.argmax(top >= 0.99 * counts.sum())) + 1
    assert report["heldout_coverage_by_size"] is None and report["heldout_units"] == 0  # fewer than 10 shards


def test_vocab_larger_than_the_target_vocabulary_is_a_user_error(make_cfg, tmp_path):
    with pytest.raises(UserError, match=r"draft_vocab_size=2000: must be in \[1, 1024\]"):
        run_stages(
            make_cfg("+experiment=tiny", "data.limit=2", "vocab.draft_vocab_size=2000", run_dir=tmp_path)
        )
