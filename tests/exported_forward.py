"""The exported draft's reference forward (pipeline.acceptance.ExportedDraft) against speculators' own
forward of the trained weights, on one sample: the logits of TTT step 0. Shared by test_evaluate (Llama
target,
default rope) and test_kimi_tiny (DeepSeek-V3 target, yarn rope; the Llama and the MLA draft)."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from pipeline.acceptance.draft_model import ExportedDraft
from pipeline.data.features_dataset import collate
from pipeline.formats import export_layouts as lay
from pipeline.models import draft, targets
from pipeline.training.setup import load_inputs


def exported_minus_speculators_logits(cfg, run_dir: Path) -> float:
    """max |ExportedDraft logits - speculators logits| over one held-in sample."""
    store, d2t, t2d, _ = load_inputs(cfg)
    folder = Path(store.facts["target_path"])
    config = json.loads((run_dir / "export" / "sglang" / "config.json").read_text())
    model = draft.build(
        folder,
        targets.load_config(folder, cfg.target),
        store.aux_layer_ids,
        d2t,
        t2d,
        1,
        arch=lay.draft_arch_of_export(config).name,
    ).eval()
    weights = load_file(str(run_dir / "train" / "final" / "model.safetensors"))
    model.load_state_dict(weights, strict=False)
    batch = collate(store, [0], 10_000)
    batch.pop("verifier_last_hidden_states")
    logits = []
    model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o))
    with torch.no_grad():
        model(**{k: (v.float() if v.is_floating_point() else v) for k, v in batch.items()}, ttt_steps=1)
    dr = ExportedDraft(
        {lay.speculators_to_sglang_name(k): v for k, v in weights.items()},
        config,
        model.embed_tokens.weight.detach(),
    )
    h = dr.layer(batch["input_ids"][0], dr.fuse(batch["hidden_states"][0]), batch["position_ids"][0])
    mine = dr._rms(h, "norm.weight") @ dr.w["lm_head.weight"].T
    return float((mine - logits[0][0]).abs().max())
