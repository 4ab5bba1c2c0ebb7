"""extract.store_dtype=fp8_e4m3 (issue #16 item 2): the same captured states as the bf16 store, within e4m3's
rounding per token and layer, about half the bytes; a store of its own (facts, fingerprint); training reads
it."""

import shutil

import pytest
import torch

from pipeline.formats.feature_store import FeatureStore
from pipeline.runner import run_stages
from pipeline.stages import extract

pytestmark = pytest.mark.slow
COMMON = ["+experiment=tiny", "data.limit=24", "train.max_steps=3", "train.val_every_steps=1000"]


def _bytes(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and ".zarr" in str(p))


@pytest.fixture(scope="module")
def stores(make_cfg, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    run_stages(make_cfg(*COMMON, "stage=prepare", run_dir=root / "bf16"))
    shutil.copytree(root / "bf16" / "prepared", root / "fp8" / "prepared")
    run_stages(make_cfg(*COMMON, "stage=extract", run_dir=root / "bf16"))
    run_stages(make_cfg(*COMMON, "extract.store_dtype=fp8_e4m3", "stage=extract", run_dir=root / "fp8"))
    return root


def test_fp8_states_are_the_bf16_states_within_e4m3_rounding_per_token_and_layer(stores):
    a, b = FeatureStore(stores / "bf16" / "features"), FeatureStore(stores / "fp8" / "features")
    assert b.facts["store_dtype"] == "fp8_e4m3" and "store_dtype" not in a.facts and len(a) == len(b)
    n_aux, worst = len(a.aux_layer_ids), 0.0
    for i in range(len(a)):
        x, y = a.sample(i), b.sample(i)
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        for key, groups in (("aux_hidden", n_aux), ("last_hidden", 1)):
            ref, got = (t.float().reshape(t.shape[0], groups, -1) for t in (x[key], y[key]))
            err = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max()
            worst = max(worst, float(err))
    assert 2**-9 < worst <= 2**-4 + 2**-9, worst
    assert _bytes(stores / "fp8" / "features") < 0.7 * _bytes(stores / "bf16" / "features")


def test_the_fp8_store_has_its_own_fingerprint_and_trains(make_cfg, stores):
    fp = {
        d: extract.fingerprint(make_cfg(*COMMON, *extra, run_dir=stores / d))
        for d, extra in (("bf16", []), ("fp8", ["extract.store_dtype=fp8_e4m3"]))
    }
    assert fp["bf16"] != fp["fp8"]
    for stage in ("vocab", "train"):
        run_stages(
            make_cfg(*COMMON, "extract.store_dtype=fp8_e4m3", f"stage={stage}", run_dir=stores / "fp8")
        )
    assert (stores / "fp8" / "train" / "final" / "model.safetensors").is_file()
