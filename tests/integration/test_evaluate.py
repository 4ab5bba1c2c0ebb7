"""Offline evaluation: our SGLang-layout draft forward equals speculators', speculation equals greedy."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.models import draft, targets
from pipeline.stages import train
from pipeline.acceptance.offline import ExportedDraft
from pipeline.data.features_dataset import collate
from pipeline.formats import export_layouts as lay
from pipeline.runner import run_stages

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def evaluated(make_cfg, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("eval_run")
    # the target's own greedy answers (first 3 turns of 64 chats), 10 epochs: val full_acc_0 ~0.44
    cfg = make_cfg("+experiment=tiny", "prepare.regenerate=true", "prepare.max_new_tokens=24",
                   "prepare.max_assistant_turns=3", "data.limit=64", "train.max_steps=null", "train.epochs=10",
                   "eval.num_prompts=10", "eval.max_new_tokens=24", run_dir=run_dir)
    run_stages(cfg)
    return cfg, run_dir


def test_exported_draft_forward_equals_speculators_forward(evaluated):
    cfg, run_dir = evaluated
    store, d2t, t2d, _ = train.load_inputs(cfg)
    folder = Path(store.facts["target_path"])
    model = draft.build(folder, targets.load_config(folder, cfg.target), store.aux_layer_ids, d2t, t2d, 1).eval()
    weights = load_file(str(run_dir / "train" / "final" / "model.safetensors"))
    model.load_state_dict(weights, strict=False)
    batch = collate(store, [0], 10_000)
    batch.pop("verifier_last_hidden_states")
    logits = []
    model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o))
    with torch.no_grad():
        model(**{k: (v.float() if v.is_floating_point() else v) for k, v in batch.items()}, ttt_steps=1)
    config = json.loads((run_dir / "export" / "sglang" / "config.json").read_text())
    dr = ExportedDraft({lay.speculators_to_sglang_name(k): v for k, v in weights.items()}, config,
                       load_file(str(folder / "model.safetensors"))["model.embed_tokens.weight"])
    h = dr.layer(batch["input_ids"][0], dr.fuse(batch["hidden_states"][0]), batch["position_ids"][0])
    mine = dr._rms(h, "norm.weight") @ dr.w["lm_head.weight"].T
    assert torch.allclose(mine, logits[0][0], atol=1e-5, rtol=0)


def test_speculative_decoding_equals_greedy_and_the_trained_draft_beats_the_floor(evaluated):
    _, run_dir = evaluated
    report = json.loads((run_dir / "eval" / "acceptance.json").read_text())
    for name in ("trained", "untrained"):
        for k, r in report[name].items():
            assert r["greedy_mismatches"] == 0 and r["tau"] >= 1.0 and len(r["accept_per_position"]) == int(k)
    for k in map(str, report["draft_lengths"]):  # measured 1.35 / 1.49 / 1.60 against 1.00 for k = 1 / 2 / 3
        assert report["untrained"][k]["tau"] == 1.0
        assert report["trained"][k]["tau"] > 1.25 + 0.05 * int(k), (k, report["trained"][k]["tau"])
    assert (run_dir / "eval" / "tau.png").stat().st_size > 5_000
