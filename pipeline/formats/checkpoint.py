"""Training checkpoints: train/step_NNNNNN/ = accelerate `save_state` + train_state.json. Pure module.

A checkpoint is written under `step_NNNNNN.tmp`, renamed when complete; `train_state.json` inside it is
what resume reads (never the directory name). The newest K complete checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

SCHEMA_VERSION = 1
STATE = "train_state.json"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def begin(root: Path, step: int) -> Path:
    tmp = step_dir(root, step).with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def finish(root: Path, tmp: Path, state: dict, keep_last: int) -> Path:
    (tmp / STATE).write_text(
        json.dumps({"schema_version": SCHEMA_VERSION, **state}, indent=1, sort_keys=True)
    )
    final = step_dir(root, state["optimizer_step"])
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in complete(root)[:-keep_last] if keep_last else []:
        shutil.rmtree(old[0])
    shutil.rmtree(Path(root) / REPLACED, ignore_errors=True)  # this run has a checkpoint of its own now
    return final


def complete(root: Path) -> list[tuple[Path, dict]]:
    """Complete checkpoints, oldest first, ordered by the step recorded inside them."""
    found = []
    for d in Path(root).glob("step_*"):
        if d.is_dir() and not d.name.endswith(".tmp") and (d / STATE).is_file():
            state = json.loads((d / STATE).read_text())
            if state.get("schema_version") == SCHEMA_VERSION:
                found.append((d, state))
    return sorted(found, key=lambda x: x[1]["optimizer_step"])


def latest(root: Path) -> tuple[Path, dict] | None:
    found = complete(root)
    return found[-1] if found else None


REPLACED = ".replaced"  # train/.replaced/: what a fresh start set aside, deleted once it has a checkpoint


def set_aside(root: Path) -> int:
    """A fresh start (train.resume=never, or nothing to resume): move every checkpoint and the final export
    into root/.replaced/, where resume never looks. They are deleted only when this run commits its first
    checkpoint
    (`finish`), so a run that fails before that (a damaged chunk, a crash) has destroyed nothing."""
    moved = _checkpoint_dirs(root)
    if moved:
        aside = Path(root) / REPLACED / f"{len(list((Path(root) / REPLACED).glob('*'))):03d}"
        aside.mkdir(parents=True)
        for d in moved:
            os.replace(d, aside / d.name)
    return len(moved)


def _checkpoint_dirs(root: Path) -> list[Path]:
    return [d for d in Path(root).glob("step_*") if d.is_dir()] + [
        d for d in [Path(root) / "final"] if d.is_dir()
    ]
