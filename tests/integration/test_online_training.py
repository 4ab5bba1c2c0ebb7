"""train.features=online (issue #16 item 1): the training job runs the frozen target on each pack with
extract's capture code and trains exactly as from the feature store; no features/ is written; resume is exact.

One prepared set (tiny, fp32 on CPU), trained twice over the same packs: offline (extract -> vocab -> train)
and
online (vocab -> train, no extract); then the online run resumed from its step-4 checkpoint."""

import json
import shutil

import pytest
from safetensors.torch import load_file

from pipeline.errors import UserError
from pipeline.formats.summary import rows
from pipeline.runner import run_stages

pytestmark = pytest.mark.slow
COMMON = [
    "+experiment=tiny",
    "data.limit=32",
    "train.max_steps=8",
    "train.log_every_steps=1",
    "train.val_every_steps=4",
    "train.save_every_steps=4",
    "train.keep_last=5",
    "train.device=cpu",
]
ONLINE = "train.features=online"


def _final(run_dir):
    return load_file(str(run_dir / "train" / "final" / "model.safetensors"))


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(make_cfg, tmp_path_factory):
    root = tmp_path_factory.mktemp("online_training")
    off, on = root / "offline", root / "online"
    run_stages(make_cfg(*COMMON, "stage=prepare", run_dir=off))
    shutil.copytree(off / "prepared", on / "prepared")
    for stage in ("extract", "vocab", "train"):
        run_stages(make_cfg(*COMMON, f"stage={stage}", run_dir=off))
    for stage in ("vocab", "train"):
        run_stages(make_cfg(*COMMON, ONLINE, f"stage={stage}", run_dir=on))
    resumed = root / "resumed"
    for part in ("prepared", "vocab"):
        shutil.copytree(on / part, resumed / part)
    shutil.copytree(on / "train" / "step_000004", resumed / "train" / "step_000004")
    run_stages(make_cfg(*COMMON, ONLINE, "stage=train", run_dir=resumed))
    return {"offline": off, "online": on, "resumed": resumed}


def test_online_training_writes_no_feature_store_and_counts_the_same_vocabulary(runs):
    assert not (runs["online"] / "features").exists() and (runs["offline"] / "features").is_dir()
    a, b = (json.loads((runs[k] / "vocab" / "report.json").read_text()) for k in ("offline", "online"))
    assert a["supervised_tokens"] == b["supervised_tokens"] and a["top_tokens"] == b["top_tokens"]
    from pipeline.formats import vocab_map

    (d2t_a, t2d_a, _), (d2t_b, t2d_b, _) = (vocab_map.load(runs[k] / "vocab") for k in ("offline", "online"))
    assert (d2t_a == d2t_b).all() and (t2d_a == t2d_b).all()


def test_online_and_offline_give_the_same_loss_curve_and_final_weights(runs):
    off, on = _metrics(runs["offline"]), _metrics(runs["online"])
    assert [(r["split"], r["step"]) for r in off] == [(r["split"], r["step"]) for r in on]
    for a, b in zip(off, on):
        for key in ("loss", "loss_0", "loss_1", "loss_2"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(abs(a[key]), 1e-3), (a["step"], key, a[key], b[key])
    a, b = _final(runs["offline"]), _final(runs["online"])
    assert a.keys() == b.keys()
    assert max(float((a[k].float() - b[k].float()).abs().max()) for k in a) <= 1e-5


def test_an_online_run_resumes_exactly(runs):
    a, b = _final(runs["online"]), _final(runs["resumed"])
    assert all((a[k] == b[k]).all() for k in a)


def test_online_is_said_in_the_summary_and_extract_alone_is_refused(runs, make_cfg):
    extract_row = next(r for r in rows(runs["online"], ["extract"], set()) if r[0] == "extract")
    assert "train.features=online" in extract_row[2]
    with pytest.raises(UserError, match="train.features=online writes no feature store"):
        run_stages(make_cfg(*COMMON, ONLINE, "stage=extract", run_dir=runs["online"]))
    with pytest.raises(UserError, match="captures with the hf backend in bf16"):
        run_stages(
            make_cfg(*COMMON, ONLINE, "extract.store_dtype=fp8_e4m3", "stage=train", run_dir=runs["online"])
        )
