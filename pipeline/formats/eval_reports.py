"""evaluate's reports, one home for their names: per prompt set folder (eval/ for the held-out prompts,
eval/<set>/ for the others) acceptance.json (offline tau, pipeline/acceptance/offline.py) or online.json (a
server's accept length and speedup, pipeline/serving/bench.py); over the sets, sets.json / sets_online.json.
"""

from __future__ import annotations

import json
from pathlib import Path

OFFLINE = "acceptance.json"
ONLINE = "online.json"
SETS = "sets.json"
SETS_ONLINE = "sets_online.json"
TAU_PNG = "tau.png"  # beside acceptance.json: tau per draft length with its intervals (formats/eval_plots.py)
ONLINE_PNG = "online.png"  # beside online.json: tokens/s and speedup per concurrency


def name(online: bool) -> str:
    """The report a bench writes into a prompt set's folder."""
    return ONLINE if online else OFFLINE


def sets_name(online: bool) -> str:
    return SETS_ONLINE if online else SETS


def read(folder: Path, online: bool) -> dict:
    return json.loads((Path(folder) / name(online)).read_text())


def write(folder: Path, online: bool, report: dict) -> Path:
    path = Path(folder) / name(online)
    path.write_text(json.dumps(report, indent=1))
    return path
