"""Capturing a transformers target's hidden states: padding, batches, forward hooks (the aux-layer numbering:
pipeline/capture/aux_layers.py).

Used by stage `extract` (backend hf) to write the feature store, and by stage `evaluate` to feed the draft
the same states while it decodes: one implementation, so what the draft is evaluated on is what it was
trained on. Aux id k = output of 0-based decoder layer k (the residual stream after it, = HF
hidden_states[k+1]); last = the PRE-norm output of the final decoder layer (HF's hidden_states[-1] has the
final norm applied, which is not what EAGLE-3 trains on). docs/conventions.md.
"""

from __future__ import annotations

import torch


def pad_batch(seqs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input_ids and attention mask: real tokens keep their positions."""
    width = max(len(x) for x in seqs)
    input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, x in enumerate(seqs):
        input_ids[r, : len(x)] = torch.as_tensor(x)
        attn[r, : len(x)] = 1
    return input_ids, attn


def plan_batches(lengths: list[int], batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Length-bucketed batches of local indices: longest first, padded size <= batch_tokens. Extract's
    batches,
    and the online source's for a pack (the same limits, extract.batch_tokens / max_batch_size)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, current = [], []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and ((len(current) + 1) * longest > batch_tokens or len(current) >= max_batch_size):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def valid_rows(h: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[B, W, D] right-padded states -> [sum(lengths), D], the real tokens row after row, gathered on the
    device
    (an index built on the host: no device sync, and no padding crosses to the host)."""
    width = h.shape[1]
    idx = torch.cat([torch.arange(n) + r * width for r, n in enumerate(lengths)])
    return h.flatten(0, 1).index_select(0, idx.to(h.device, non_blocking=True))


class Capture:
    """Forward hooks on decoder layers. `__call__` runs the decoder and returns (aux [B,T,n*H], last [B,T,H])
    in bf16; `states()` returns the same from the model's most recent forward, whoever ran it."""

    def __init__(self, model, aux_ids: list[int]):
        self.base = model.get_decoder()
        layers = self.base.layers
        self.aux_ids, self.last_id = list(aux_ids), len(layers) - 1
        self._seen: dict[int, torch.Tensor] = {}
        self.handles = [
            layers[k].register_forward_hook(self._hook(k)) for k in sorted(set(aux_ids) | {self.last_id})
        ]

    def _hook(self, k: int):
        def hook(module, args, output):
            self._seen[k] = (output[0] if isinstance(output, tuple) else output).to(torch.bfloat16)

        return hook

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux concatenated in aux_ids order, last) of the latest forward."""
        return torch.cat([self._seen[k] for k in self.aux_ids], dim=-1), self._seen[self.last_id]

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._seen.clear()
        self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return self.states()

    def packed(self, samples: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples' states without padding: (aux [sum(len), n*H], last [sum(len), H]), sample after
        sample,
        on the model's device (what extract writes; SGLangCapture.packed gives the same from SGLang)."""
        input_ids, attention_mask = pad_batch(samples)
        device = next(self.base.parameters()).device
        aux, last = self(input_ids.to(device), attention_mask.to(device))
        lengths = [len(s) for s in samples]
        return valid_rows(aux, lengths), valid_rows(last, lengths)

    def release(self) -> None:
        """Drop the latest forward's states (the caller copied what it needs)."""
        self._seen.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
