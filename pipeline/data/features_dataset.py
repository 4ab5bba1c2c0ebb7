"""Training data over the feature store: deterministic split, shuffle and packing, per-rank sharding.

A *pack* is a list of pieces whose lengths fit `tokens_per_pack`; it becomes one [1, T] micro-batch with
document ids (the draft's attention never crosses pieces) and position ids that keep each token's place in its
sample. Alignment follows speculators' `shift_batch`: position t pairs input token x[t+1] and the aux state
g[t] with the target's last state y[t+1] (which predicts x[t+2]); a sample of n tokens has n-1 such positions.
A position is scored (loss and accuracy) iff l[t+1] and l[t+2]: the input and the predicted token are both the
answer's. shift_batch's l[t+1] alone also scores the token after each end-of-turn, which serving never asks
for (the draft stops at EOS) and which the draft always hits: 4.6 % of the demo's positions (issue #47).
A *piece* is (sample, start, context): positions [start, start + T) of that sample, the first `context` of
them loss-masked. A sample whose n-1 positions fit one pack is one piece (i, 0, 0). A longer one is split
(`split_points`): windows of T positions with stride T - context, so every position is trained exactly once
and each later window starts with `context` already-trained positions that the draft attends to but is not
scored on. Nothing is cut (issue #12, B7).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from pipeline.formats.feature_store import ChunkError, FeatureStore

PAD_FILL = {"document_ids": -1}  # a padded position's values: its own document, everything else 0
STORE_ERROR = "store_error"  # a pack that could not be read: {STORE_ERROR: the ChunkError's message}


def split(
    num_samples: int, val_fraction: float, seed: int, heldout: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) sample indices: the samples prepare set aside (`heldout`, data=mix's per-source held-out
    conversations: val is exactly those of them in the store, val_fraction is not used), else held out by
    sample
    with a seeded permutation."""
    if heldout:
        val = np.unique(np.asarray(heldout, dtype=np.int64))
        val = val[val < num_samples]
        return np.setdiff1d(np.arange(num_samples), val), val
    perm = np.random.default_rng(seed).permutation(num_samples)
    n_val = min(num_samples - 1, math.ceil(num_samples * val_fraction)) if val_fraction > 0 else 0
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


Piece = tuple[int, int, int]  # (sample index, first position, leading positions that are context only)


def split_points(positions: int, tokens_per_pack: int, context: int) -> list[tuple[int, int]]:
    """(start, context) of each window that covers `positions` shifted positions in windows of at most
    tokens_per_pack; the first window has no context, each later one repeats the `context` positions before
    it."""
    if positions <= tokens_per_pack:
        return [(0, 0)]
    stride = tokens_per_pack - context
    out, start = [(0, 0)], stride
    while start + context < positions:
        out.append((start, context))
        start += stride
    return out


def plan_packs(
    indices: np.ndarray,
    lengths: np.ndarray,
    tokens_per_pack: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    context: int = 0,
) -> list[list[Piece]]:
    order = np.random.default_rng([seed, epoch]).permutation(indices) if shuffle else np.asarray(indices)
    packs, current, used = [], [], 0
    for i in order.tolist():
        m = int(lengths[i]) - 1
        if m < 1:
            continue  # a 1-token sample has nothing to predict (counted by the caller via lengths)
        for start, ctx in split_points(m, tokens_per_pack, context):
            n = min(m - start, tokens_per_pack)
            if current and used + n > tokens_per_pack:
                packs.append(current)
                current, used = [], 0
            current.append((i, start, ctx))
            used += n
    if current:
        packs.append(current)
    return packs


def split_counts(indices: np.ndarray, lengths: np.ndarray, tokens_per_pack: int, context: int) -> dict:
    """What splitting does to these samples: how many are split, into how many pieces, how many positions are
    repeated as context. Positions trained = all of them, each once."""
    samples = pieces = repeated = 0
    for i in np.asarray(indices).tolist():
        points = split_points(int(lengths[i]) - 1, tokens_per_pack, context)
        if len(points) > 1:
            samples, pieces, repeated = (
                samples + 1,
                pieces + len(points),
                repeated + sum(c for _, c in points),
            )
    return {
        "samples": samples,
        "pieces": pieces,
        "context_positions": repeated,
        "positions": int((np.asarray(lengths)[np.asarray(indices, dtype=int)] - 1).clip(min=0).sum()),
    }


def shard_for_rank(packs: list, rank: int, world: int) -> list:
    """Every rank gets the same number of packs (the tail that does not divide is dropped)."""
    usable = len(packs) - len(packs) % world
    return packs[rank:usable:world]


def collate(
    store: FeatureStore, pack: list, tokens_per_pack: int, pad: bool = False, with_answer_index: bool = False
) -> dict[str, torch.Tensor]:
    """One [1, T] micro-batch from a pack of pieces (a bare sample index = the whole sample, which must fit).
    pad=True: padded to exactly tokens_per_pack (document id -1, loss mask 0, zero states), so every step has
    one shape; speculators' mask keeps a padded position to itself and its loss counts nothing.
    with_answer_index=True adds `answer_index`: each input token's index within its answer over the whole
    sample (-1 outside; validation's evaluate positions), which the draft's forward does not take."""
    parts = {
        k: []
        for k in (
            "input_ids",
            "hidden_states",
            "verifier_last_hidden_states",
            "loss_mask",
            "position_ids",
            "document_ids",
        )
    }
    if hasattr(store, "prefetch"):  # online: the pack's samples through the target in one forward
        store.prefetch([piece if isinstance(piece, int) else piece[0] for piece in pack])
    for doc, piece in enumerate(pack):
        i, start, context = (piece, 0, 0) if isinstance(piece, int) else piece
        s = store.sample(i)
        m = len(s["input_ids"]) - 1
        if isinstance(piece, int) and m > tokens_per_pack:
            raise ValueError(
                f"sample {i} has {m} positions, more than tokens_per_pack={tokens_per_pack}: "
                f"plan it with plan_packs, which splits it"
            )
        n = min(m - start, tokens_per_pack)
        a, b = start, start + n
        mask = s["loss_mask"][a + 1 : b + 1].bool().clone()
        # scored only where the predicted token x[t+2] is the answer's too: never the token after its
        # end-of-turn (serving stops there; it was a trivial hit in every validation figure, issue #47)
        nxt = s["loss_mask"][a + 2 : b + 2].bool()
        mask[: len(nxt)] &= nxt
        mask[len(nxt) :] = False
        mask[:context] = False  # positions already trained in the window before: context only
        parts["input_ids"].append(s["input_ids"][a + 1 : b + 1])
        parts["hidden_states"].append(s["aux_hidden"][a:b])
        parts["verifier_last_hidden_states"].append(s["last_hidden"][a + 1 : b + 1])
        parts["loss_mask"].append(mask)
        parts["position_ids"].append(torch.arange(a + 1, b + 1))
        parts["document_ids"].append(torch.full((n,), doc, dtype=torch.long))
        if with_answer_index:
            parts.setdefault("answer_index", []).append(answer_index(s["loss_mask"])[a + 1 : b + 1])
    extra = tokens_per_pack - sum(len(x) for x in parts["input_ids"]) if pad else 0
    if extra > 0:  # padded on the right inside the one concatenation (no second copy of the pack)
        for k, v in parts.items():
            v.append(v[0].new_full((extra, *v[0].shape[1:]), PAD_FILL.get(k, 0)))
    return {k: torch.cat(v)[None] for k, v in parts.items()}


def answer_index(loss_mask: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[n] index of each token within its supervised run (0 = an answer's first token, -1 outside one). A run
    starts where the mask turns on or, given document_ids, the document changes."""
    m = loss_mask.bool()
    pos = torch.arange(len(m), device=m.device)
    prev_on = torch.zeros_like(m)
    prev_on[1:] = m[:-1] if document_ids is None else m[:-1] & (document_ids[1:] == document_ids[:-1])
    first = torch.cummax(torch.where(m & ~prev_on, pos, torch.zeros_like(pos)), 0).values
    return torch.where(m, pos - first, torch.full_like(pos, -1))


class PackDataset(torch.utils.data.Dataset):
    """Map-style over a fixed list of packs; opens the store lazily (once per DataLoader worker)."""

    def __init__(self, source, packs: list[list[Piece]], tokens_per_pack: int, pad: bool = False):
        """source: the store's folder (opened in each worker), or an open source (online: the target
        itself)."""
        opened = not isinstance(source, (str, Path))
        self.root = None if opened else Path(source)
        self.packs, self.tokens_per_pack, self.pad = packs, tokens_per_pack, pad
        self._store = source if opened else None

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        if self._store is None:
            self._store = FeatureStore(self.root)
        try:
            return collate(self._store, self.packs[k], self.tokens_per_pack, self.pad)
        except ChunkError as e:  # a DataLoader worker would re-raise it wrapped in its traceback text
            return {STORE_ERROR: str(e)}
