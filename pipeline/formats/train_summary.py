"""train/final/train_summary.json, one home: what a training run made (steps, validation before and after,
the held-out samples, the weights the export takes, throughput, memory, the resolved config). Written once by
the train stage when final/ is complete; read by export, evaluate and the run's summary.
"""

from __future__ import annotations

import json
from pathlib import Path

FILE = "train_summary.json"


def path(final: Path) -> Path:
    return Path(final) / FILE


def exists(final: Path) -> bool:
    return path(final).is_file()


def read(final: Path) -> dict | None:
    """The summary of the draft in `final` (train/final/), or None where train has not finished."""
    p = path(final)
    return json.loads(p.read_text()) if p.is_file() else None


def write(final: Path, summary: dict) -> Path:
    p = path(final)
    p.write_text(json.dumps(summary, indent=1, default=str))
    return p
