"""The sha256 of finished files (checkpoints, exports): recorded when they are written, checked before they
are used (issue #35, rule 3). Pure module.

A record is {relative path: {"bytes": size, "sha256": hex}}. Checking reads every byte again (hashlib, 8 MiB
blocks, about 1 GB/s on one core): a Kimi-K2.5 draft checkpoint (~16 GB with its optimizer state) costs some
15-30 s when it is written and as much when it is resumed; an export (1-3 GB) a second or two at each
`stage=all`. A size that differs is reported without reading the file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

BLOCK = 8 << 20  # bytes read at a time


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
    return h.hexdigest()


def record(folder: Path, names: list[str] | None = None) -> dict[str, dict]:
    """The record of `names` under folder (relative paths), or of every file below it (names=None)."""
    folder = Path(folder)
    if names is None:
        names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return {n: {"bytes": (folder / n).stat().st_size, "sha256": sha256(folder / n)} for n in names}


def problems(folder: Path, recorded: dict[str, dict]) -> list[str]:
    """What differs from the record, one phrase per file (empty: every recorded file as it was written)."""
    out = []
    for name, want in sorted(recorded.items()):
        path = Path(folder) / name
        if not path.is_file():
            out.append(f"{name} is missing")
        elif (size := path.stat().st_size) != want["bytes"]:
            cut = "cut short" if size < want["bytes"] else "grown"
            out.append(f"{name} is {cut} ({size} bytes, {want['bytes']} when written)")
        elif sha256(path) != want["sha256"]:
            out.append(f"{name}'s sha256 differs from the one recorded when it was written")
    return out
