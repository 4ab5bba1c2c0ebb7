"""Batched greedy-chain speculation for the offline bench: B prompts at once, the same algorithm as
`offline.speculate` (kept as the reference; tests hold the two equal on tiny).

Rows diverge (each accepts its own number of proposals), so neither cache is cropped: every round appends the
same number of slots to every row, and a validity mask [B, slots] says which slots hold the row's real
sequence. A rejected proposal's slot stays, masked out for good; positions count valid slots only.
- target: one HF DynamicCache over B rows, the 2-D attention mask and per-row position ids passed each call;
  the aux states of the verified tokens come from the same capture hooks as extract's (capture.hf.Capture).
- draft (ExportedDraft, SGLang's forward of the exported tensors): a per-row cache of the per-head K
and
  V of its context (token t+1 with the target's fused aux state t); each round's chain entries (a proposal
  with the draft's own output state) are attended to and then dropped, as SGLang's draft does.
Acceptance is computed on the device; one host transfer per round reads the accepted lengths and tokens.
"""

from __future__ import annotations

import torch

from pipeline.capture.hf import Capture, pad_batch


class TargetRows:
    """The target over B rows with one padded KV cache."""

    def __init__(self, model, capture: Capture, rows: int):
        from transformers import DynamicCache

        self.model, self.capture, self.dev = model, capture, model.device
        self.cache = DynamicCache()
        self.mask = torch.zeros(rows, 0, dtype=torch.bool, device=self.dev)
        self.next_pos = torch.zeros(rows, dtype=torch.long, device=self.dev)

    def forward(self, ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, valid [B, N] (valid slots of a row first); (logits [B, N, V], aux [B, N, n_aux*H]) of the
        step."""
        pos = self.next_pos[:, None] + (valid.long().cumsum(1) - 1).clamp(min=0)
        self.mask = torch.cat([self.mask, valid], 1)
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask.long(),
            position_ids=pos,
            past_key_values=self.cache,
            use_cache=True,
        )
        return out.logits, self.capture.states()[0]

    def keep(self, kept: torch.Tensor) -> None:
        """The last step's slots that hold the real sequence [B, N]; the others are masked out from now on."""
        self.mask[:, -kept.shape[1] :] = kept
        self.next_pos += kept.sum(1)


class DraftRows:
    """The draft's per-row context cache (per-head K, V and a validity mask)."""

    def __init__(self, dr, rows: int):
        self.dr, self.k, self.v = dr, None, None
        self.mask = torch.zeros(rows, 0, dtype=torch.bool, device=dr.embed.device)
        self.n = torch.zeros(rows, dtype=torch.long, device=dr.embed.device)  # context entries per row

    def extend(self, tokens: torch.Tensor, hidden: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Append context entries [B, N] (valid ones first in each row); the layer's output at each row's
        last."""
        dr, rows = self.dr, torch.arange(tokens.shape[0], device=tokens.device)
        pos = self.n[:, None] + 1 + torch.arange(tokens.shape[1], device=tokens.device)
        q, k, v = dr.qkv(dr.inputs(tokens, hidden), pos)
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        self.mask = torch.cat([self.mask, valid], 1)
        last = valid.sum(1) - 1
        self.n += valid.sum(1)
        attn = dr.attend(q[rows, :, last][:, :, None], self.k, self.v, mask=self.mask[:, None, None, :])
        return dr.finish(hidden[rows, last][:, None], attn)[:, 0]

    def chain(
        self, tokens: torch.Tensor, hidden: torch.Tensor, step: int, ck: list, cv: list
    ) -> torch.Tensor:
        """One chain entry per row (proposal `step`, 1-based, with the draft state that proposed it) at
        position
        context + step; its output [B, H]."""
        dr = self.dr
        q, k, v = dr.qkv(dr.inputs(tokens[:, None], hidden[:, None]), (self.n + step)[:, None])
        ck.append(k)
        cv.append(v)
        mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], len(ck))], 1)
        attn = dr.attend(
            q, torch.cat([self.k, *ck], 2), torch.cat([self.v, *cv], 2), mask=mask[:, None, None, :]
        )
        return dr.finish(hidden[:, None], attn)[:, 0]


def _take(
    rows_new: list[list[int]], generated: list[list[int]], active: list[bool], max_new: int, eos
) -> None:
    for r, new in enumerate(rows_new):
        if not active[r]:
            continue
        for t in new:
            generated[r].append(t)
            if t == eos or len(generated[r]) >= max_new:
                active[r] = False
                break


def _prefill(model, capture: Capture, prompts: list[list[int]]):
    dev = model.device
    ids, attn = pad_batch(prompts)
    ids, valid = ids.to(dev), attn.bool().to(dev)
    target = TargetRows(model, capture, len(prompts))
    logits, aux = target.forward(ids, valid)
    target.keep(valid)
    lengths = valid.sum(1)
    rows = torch.arange(len(prompts), device=dev)
    return target, ids, valid, aux, logits[rows, lengths - 1].argmax(-1)


@torch.no_grad()
def greedy(model, capture: Capture, prompts: list[list[int]], max_new: int, eos) -> list[list[int]]:
    """Plain greedy decoding of B prompts (the reference every speculative run must equal); stops a row at eos
    (kept) or max_new tokens, as transformers' generate does."""
    target, _, _, _, nxt = _prefill(model, capture, prompts)
    generated, active = [[] for _ in prompts], [True] * len(prompts)
    _take([[t] for t in nxt.tolist()], generated, active, max_new, eos)
    while any(active):
        logits, _ = target.forward(nxt[:, None], torch.ones_like(nxt[:, None], dtype=torch.bool))
        target.keep(torch.ones_like(nxt[:, None], dtype=torch.bool))
        nxt = logits[:, -1].argmax(-1)
        _take([[t] for t in nxt.tolist()], generated, active, max_new, eos)
    return generated


@torch.no_grad()
def speculate(model, capture: Capture, dr, prompts: list[list[int]], max_new: int, k, eos):
    """Greedy chain speculative decoding of B prompts at once. `k`: the draft length, one for every row or
    one per
    row (a list): rows of several draft lengths share every forward, a shorter row's extra proposals and
    verify slots masked out. Returns, per prompt, (generated ids, accepted proposals per round): what
    offline.speculate
    returns for that prompt alone at its k."""
    B, dev = len(prompts), model.device
    ks = torch.tensor([k] * B if isinstance(k, int) else list(k), device=dev)
    if ks.numel() != B or int(ks.min()) < 1:
        raise ValueError(f"speculate: draft lengths {ks.tolist()} for {B} prompts")
    k = int(ks.max())
    target, ids, valid, aux, nxt = _prefill(model, capture, prompts)
    rows = torch.arange(B, device=dev)
    draft = DraftRows(dr, B)
    # context entry i of a row: token i+1 with the target's aux state i (the prompt shifted, then nxt)
    tok = torch.cat([ids[:, 1:], ids.new_zeros(B, 1)], 1)
    tok[rows, valid.sum(1) - 1] = nxt
    hid, ctx_valid = dr.fuse(aux), valid
    generated, rounds, active = [[] for _ in prompts], [[] for _ in prompts], [True] * B
    _take([[t] for t in nxt.tolist()], generated, active, max_new, eos)
    steps = torch.arange(k + 1, device=dev)
    own = (
        steps[None] <= ks[:, None]
    )  # [B, k + 1]: nxt and the row's own k proposals (a shorter row: the rest masked)
    while any(active):
        h = draft.extend(tok, hid, ctx_valid)
        props, ck, cv = [dr.next_target_ids(h)], [], []
        for j in range(1, k):  # the chain: each step feeds the draft's own output state back
            h = draft.chain(props[-1], h, j, ck, cv)
            props.append(dr.next_target_ids(h))
        props = torch.stack(props, 1)  # [B, k]
        logits, aux = target.forward(torch.cat([nxt[:, None], props], 1), own)
        verify = logits.argmax(-1)  # [B, k + 1]
        a = (
            ((verify[:, :k] == props) & own[:, 1:]).long().cumprod(1).sum(1)
        )  # accepted proposals per row (<= its k)
        ctx_valid = (
            steps[None] <= a[:, None]
        )  # nxt and the accepted proposals; rejected slots masked for good
        target.keep(ctx_valid)
        tok = torch.where(steps[None] < a[:, None], torch.cat([props, props[:, :1]], 1), verify)
        nxt = verify[rows, a]
        tok[rows, a] = nxt
        hid = dr.fuse(aux)
        host = torch.cat([a[:, None], tok], 1).tolist()  # the round's one host transfer
        for r in range(B):
            if active[r]:
                rounds[r].append(host[r][0])
        _take([row[1 : row[0] + 2] for row in host], generated, active, max_new, eos)
    return [(g[:max_new], r) for g, r in zip(generated, rounds)]


def by_k(
    model, capture: Capture, dr, prompts: list[list[int]], max_new: int, ks, eos, batch_size: int
) -> dict:
    """{k: [(generated ids, accepted per round) per prompt]} for every draft length in `ks`: batch_size
    prompts
    at a time, each of them once per k in the same batch (batch_size x len(ks) rows share every forward: the
    forwards are launch-bound, so the draft lengths cost little more than one)."""
    ks = list(ks)
    out = {k: [] for k in ks}
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        rows = speculate(
            model, capture, dr, [p for _ in ks for p in chunk], max_new, [k for k in ks for _ in chunk], eos
        )
        for j, k in enumerate(ks):
            out[k] += rows[j * len(chunk) : (j + 1) * len(chunk)]
    return out


def tau_by_k(
    model, capture: Capture, dr, prompts: list[list[int]], max_new: int, ks, eos, batch_size: int
) -> dict:
    """{k: tau} of draft `dr` over the prompts: tokens per target forward, pooled over every round of every
    prompt
    (what evaluate reports; train logs it during training)."""
    runs = by_k(model, capture, dr, prompts, max_new, ks, eos, batch_size)
    rounds = {k: [r for _, rs in rows for r in rs] for k, rows in runs.items()}
    return {k: sum(r + 1 for r in rs) / max(len(rs), 1) for k, rs in rounds.items()}
