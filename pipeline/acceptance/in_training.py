"""tau while training (`train.eval_tau_every_steps`, issue #17): the draft as the export would serve it,
measured by the offline greedy chain, without writing a file.

At each such step rank 0 turns the draft's current weights into the SGLang export's tensors and config, with
the export stage's own functions (export_layouts.sglang_tensors / sglang_config, the same bf16 cast), and runs
the batched offline tau (acceptance/batched.py) on `eval.num_prompts` held-out prompts, k = 1..eval.max_draft,
on the fp32 target evaluate uses. So the tau logged at a step is the tau `evaluate` reports for an export of
that step.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pipeline.acceptance import batched
from pipeline.acceptance.draft_model import ExportedDraft
from pipeline.capture.hf import Capture
from pipeline.data import prompt_sets
from pipeline.errors import UserError
from pipeline.formats import export_layouts as lay
from pipeline.models import targets

log = logging.getLogger(__name__)


class TauProbe:
    def __init__(self, cfg, store, val_idx: list[int]):
        e = cfg.eval
        self.ks = list(range(1, e.max_draft + 1))
        self.max_new, self.batch_size = e.max_new_tokens, max(e.batch_size, 1)
        folder = Path(store.facts["target_path"])
        selection, _ = prompt_sets.selection_and_report(val_idx)  # evaluate reports on the other half
        self.prompts = prompt_sets.before_answer(store, selection, e.num_prompts, e.prompt_tokens)
        if not self.prompts:
            raise UserError(
                f"train.eval_tau_every_steps: none of the {len(selection)} held-out samples of the selection "
                f"half has a prompt of 2 to eval.prompt_tokens={e.prompt_tokens} tokens; raise "
                "eval.prompt_tokens or train.val_fraction"
            )
        device, _ = targets.pick_device_dtype(
            e.device, "fp32"
        )  # evaluate's setting: exact greedy, no bf16 noise
        self.model = targets.load_model(folder, cfg.target, device, torch.float32, "sdpa")
        self.model.requires_grad_(False)
        self.capture = Capture(self.model, store.aux_layer_ids)
        self.embed = self.model.get_input_embeddings().weight.detach()
        self.eos = targets.load_tokenizer(folder, cfg.target).eos_token_id
        self.vocab_size, self.hidden = int(store.facts["vocab_size"]), store.hidden_size
        self.engine_ids = lay.engine_layer_ids("sglang", store.aux_layer_ids, targets.architecture(folder))
        log.info(
            "train: tau every %d steps on %d held-out prompts x %d tokens, k = %s, target fp32 on %s",
            cfg.train.eval_tau_every_steps,
            len(self.prompts),
            self.max_new,
            self.ks,
            device,
        )

    @torch.no_grad()
    def __call__(self, weights: dict, draft_cfg: dict) -> dict[int, float]:
        """{k: tau} of these draft weights (speculators' names, any device) served as the SGLang export."""
        layer = draft_cfg["transformer_layer_config"]
        config = lay.sglang_config(
            layer,
            draft_cfg,
            self.vocab_size,
            self.hidden,
            self.engine_ids,
            lay.draft_arch_of(layer["model_type"]),
        )
        tensors = lay.sglang_tensors(
            {
                k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach())
                for k, v in weights.items()
            }
        )  # the export's cast
        draft = ExportedDraft(tensors, config, self.embed, self.model.device)
        return batched.tau_by_k(
            self.model, self.capture, draft, self.prompts, self.max_new, self.ks, self.eos, self.batch_size
        )
