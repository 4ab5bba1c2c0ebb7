"""train.optimizer: AdamW, or Muon (speculators 0.9's default) as ONE torch optimizer, so that accelerate's
wrapper, the LR schedule, gradient clipping and the checkpoints treat both alike.

Muon orthogonalizes only 2D weight matrices; speculators' own split (`split_named_params_for_muon`) sends the
draft's matrices to torch.optim.Muon and everything else (norms, the embedding, lm_head) to AdamW. `MuonAdamW`
owns both: its param_groups are theirs (read from the parts each time: a scheduler's lr change reaches the
part that steps), its state_dict holds both, and a checkpoint saved with one is refused by the other
(train_config_hash covers train.optimizer).
"""

from __future__ import annotations

import torch

from pipeline.config_choices import OptimizerChoice
from pipeline.lazy_compile import compile_deferred


class MuonAdamW(torch.optim.Optimizer):
    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.parts = [muon, adamw]
        self.defaults = {}  # (Optimizer.__init__ is not called: it would copy the groups the parts own)
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}
        self._zero_grad_profile_name = "Optimizer.zero_grad#MuonAdamW.zero_grad"

    @property
    def param_groups(self) -> list[dict]:
        """The parts' own group dicts, read each time (a part's load_state_dict replaces its list)."""
        return [g for part in self.parts for g in part.param_groups]

    @property
    def state(self) -> dict:
        return {**self.parts[0].state, **self.parts[1].state}

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.parts[0].state_dict(), "adamw": self.parts[1].state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.parts[0].load_state_dict(state["muon"])
        self.parts[1].load_state_dict(state["adamw"])

    def add_param_group(self, group: dict) -> None:
        raise NotImplementedError("MuonAdamW: its groups are fixed at construction")


def build(t, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer train.optimizer names, over the model's trainable parameters."""
    choice = t.optimizer if isinstance(t.optimizer, OptimizerChoice) else OptimizerChoice(str(t.optimizer))
    trainable = [p for p in model.parameters() if p.requires_grad]
    adamw = dict(lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.adam_betas))
    if choice == OptimizerChoice.adamw:
        return torch.optim.AdamW(trainable, **adamw)
    with compile_deferred():
        from speculators.train.optimizers import split_named_params_for_muon

    matrices, rest = split_named_params_for_muon(model)
    muon = torch.optim.Muon(
        [p for _, p in matrices],
        lr=t.muon_lr if t.muon_lr is not None else t.lr,
        momentum=t.muon_momentum,
        weight_decay=t.muon_weight_decay,
        adjust_lr_fn="match_rms_adamw",
    )
    return MuonAdamW(muon, torch.optim.AdamW([p for _, p in rest], **adamw))
