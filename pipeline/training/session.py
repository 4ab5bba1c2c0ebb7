"""What one training run holds: the data plan, the session (model, optimizer, store), the position."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.formats import feature_store as fs

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """What the data gives this rank: the sample split, the packs of every epoch, the step count."""

    train_idx: list
    val_idx: list
    epochs: (
        list  # per epoch, ALL its packs in global order (each rank takes its share from the data position)
    )
    val_packs: list
    total_steps: int
    split: dict  # samples longer than a pack: how many, into how many windows, positions repeated as context
    train_tokens: int = 0  # tokens of the training samples (one epoch), held-out ones excluded


@dataclass
class Session:
    """What one training run works with, built once by `setup`."""

    accelerator: object
    model: object
    optimizer: object
    scheduler: object
    trainable: list
    fwd: dict  # the draft's forward kwargs (TTT steps, loss)
    store: fs.FeatureStore
    root: Path
    upstream: dict  # what the weights depend on; a checkpoint of other upstream is refused
    sharded: bool = (
        False  # train.strategy=fsdp: the model is FSDP2-sharded (pipeline/models/fsdp.py), not prepared
    )
    val_idx: list = field(default_factory=list)  # held-out samples: tau's prompts come from them
    probe: object = None  # the tau probe (rank 0, made at the first tau step)
    best: dict = field(default_factory=dict)  # train.select=tau: {"step", "tau", "k"} of the best so far
    d2t: object = None  # draft id -> offset to its target id: validation maps proposals as the engines do


@dataclass
class Progress:
    step: int = 0
    epoch: int = 0
    packs_done: int = 0  # packs of `epoch` already trained, all ranks together (a global position: elastic)
