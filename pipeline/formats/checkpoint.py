"""Training checkpoints: train/step_NNNNNN/ = accelerate `save_state` + train_state.json. Pure module.

A checkpoint is written under `step_NNNNNN.tmp`, renamed when complete; `train_state.json` inside it is
what resume reads (never the directory name). The newest K complete checkpoints are kept. `finish` records in
train_state.json the sha256 of every other file (`checksums`, see file_digest for the cost: ~16 GB for a Kimi
draft) and of the state itself (`state_sha256`); `damage` checks them before resume loads the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from pipeline.formats import file_digest

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
    """Record the files' sha256 and the state, publish tmp as step_NNNNNN, keep the newest keep_last and
    the one just written (a damaged later step resume skipped stays until this run writes that step again)."""
    state = {"schema_version": SCHEMA_VERSION, **state, "checksums": file_digest.record(tmp)}
    state["state_sha256"] = _state_sha256(state)
    (tmp / STATE).write_text(json.dumps(state, indent=1, sort_keys=True))
    final = step_dir(root, state["optimizer_step"])
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in complete(root)[:-keep_last] if keep_last else []:
        if old[0] != final:
            shutil.rmtree(old[0])
    shutil.rmtree(Path(root) / REPLACED, ignore_errors=True)  # this run has a checkpoint of its own now
    return final


def complete(root: Path) -> list[tuple[Path, dict]]:
    """Complete checkpoints (their state readable), oldest first, ordered by the step recorded inside them."""
    return [(d, state) for d, state in reversed(candidates(root)) if state is not None]


def candidates(root: Path) -> list[tuple[Path, dict | None]]:
    """Every finished checkpoint folder (renamed from .tmp, with a train_state.json of this schema), newest
    first by its recorded step; state None where train_state.json cannot be read (ordered by its name)."""
    found = []
    for d in Path(root).glob("step_*"):
        if d.is_dir() and not d.name.endswith(".tmp") and (d / STATE).is_file():
            state = _read_state(d)
            if state is None or state.get("schema_version") == SCHEMA_VERSION:
                found.append((d, state))
    return sorted(found, key=lambda x: _step(*x), reverse=True)


def damage(folder: Path, state: dict | None) -> str | None:
    """What is wrong with a finished checkpoint against what `finish` recorded (None: intact). Reads every
    byte of it (file_digest: ~15-30 s for a 16 GB Kimi draft checkpoint)."""
    if state is None:
        return f"{STATE} cannot be read"
    if state.get("state_sha256") != _state_sha256(state):
        return f"{STATE} differs from the state recorded when it was written"
    return "; ".join(file_digest.problems(folder, state["checksums"])) or None


def _state_sha256(state: dict) -> str:
    body = {k: v for k, v in state.items() if k != "state_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _read_state(d: Path) -> dict | None:
    try:
        state = json.loads((d / STATE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) and isinstance(state.get("optimizer_step"), int) else None


def _step(d: Path, state: dict | None) -> int:
    if state is not None:
        return state["optimizer_step"]
    named = re.fullmatch(r"step_(\d+)", d.name)
    return int(named.group(1)) if named else -1


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
