"""Training data over the feature store: deterministic split, shuffle and packing, per-rank sharding.

A *pack* is a list of sample indices whose shifted lengths (n-1) fit `tokens_per_pack`; it becomes one
[1, T] micro-batch with document ids (the draft's attention never crosses samples) and per-sample
position ids. Alignment follows speculators' `shift_batch`: position t pairs input token x[t+1] and the
aux state g[t] with the target's last state y[t+1] and loss mask l[t+1].
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from pipeline.formats.feature_store import ChunkError, FeatureStore

STORE_ERROR = "store_error"  # a pack that could not be read: {STORE_ERROR: the ChunkError's message}


def split(num_samples: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) sample indices, held out by sample with a seeded permutation."""
    perm = np.random.default_rng(seed).permutation(num_samples)
    n_val = min(num_samples - 1, math.ceil(num_samples * val_fraction)) if val_fraction > 0 else 0
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def plan_packs(indices: np.ndarray, lengths: np.ndarray, tokens_per_pack: int, seed: int, epoch: int,
               shuffle: bool = True) -> list[list[int]]:
    order = np.random.default_rng([seed, epoch]).permutation(indices) if shuffle else np.asarray(indices)
    packs, current, used = [], [], 0
    for i in order.tolist():
        n = min(int(lengths[i]) - 1, tokens_per_pack)
        if n < 1:
            continue  # a 1-token sample has nothing to predict (counted by the caller via lengths)
        if current and used + n > tokens_per_pack:
            packs.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        packs.append(current)
    return packs


def shard_for_rank(packs: list, rank: int, world: int) -> list:
    """Every rank gets the same number of packs (the tail that does not divide is dropped)."""
    usable = len(packs) - len(packs) % world
    return packs[rank:usable:world]


def collate(store: FeatureStore, pack: list[int], tokens_per_pack: int) -> dict[str, torch.Tensor]:
    parts = {k: [] for k in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask",
                             "position_ids", "document_ids")}
    for doc, i in enumerate(pack):
        s = store.sample(i)
        n = min(len(s["input_ids"]) - 1, tokens_per_pack)
        parts["input_ids"].append(s["input_ids"][1: n + 1])
        parts["hidden_states"].append(s["aux_hidden"][:n])
        parts["verifier_last_hidden_states"].append(s["last_hidden"][1: n + 1])
        parts["loss_mask"].append(s["loss_mask"][1: n + 1].bool())
        parts["position_ids"].append(torch.arange(1, n + 1))
        parts["document_ids"].append(torch.full((n,), doc, dtype=torch.long))
    return {k: torch.cat(v)[None] for k, v in parts.items()}


class PackDataset(torch.utils.data.Dataset):
    """Map-style over a fixed list of packs; opens the store lazily (once per DataLoader worker)."""

    def __init__(self, root: Path, packs: list[list[int]], tokens_per_pack: int):
        self.root, self.packs, self.tokens_per_pack = Path(root), packs, tokens_per_pack
        self._store = None

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        if self._store is None:
            self._store = FeatureStore(self.root)
        try:
            return collate(self._store, self.packs[k], self.tokens_per_pack)
        except ChunkError as e:  # a DataLoader worker would re-raise it wrapped in its traceback text
            return {STORE_ERROR: str(e)}
