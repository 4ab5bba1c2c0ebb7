"""<cache_dir>/check_memo.json, one home: the verdicts of config checks that must import a heavy library to
judge a value (train.loss: speculators, ~8 s of every `eaglepipe submit` and SLURM job start on 2 cores),
remembered per library version so the next command judges the same value in a millisecond:

    {"speculators==0.9.0": {"train.loss=kl_div": null, "train.loss=kl_divv": "train.loss='kl_divv': ..."}}

null is "valid", a string the problem line. It is a cache: a missing, damaged or unwritable memo only means
the check runs again (nothing depends on it being there)."""

from __future__ import annotations

import json
import os
from pathlib import Path

FILE = "check_memo.json"


def path(cache_dir: str | Path) -> Path:
    return Path(cache_dir) / FILE


def read(cache_dir: str | Path) -> dict[str, dict[str, str | None]]:
    try:
        memo = json.loads(path(cache_dir).read_text())
    except (OSError, ValueError):
        return {}
    ok = isinstance(memo, dict) and all(isinstance(v, dict) for v in memo.values())
    return memo if ok else {}


def remember(cache_dir: str | Path, slot: str, entry: str, verdict: str | None) -> None:
    """Add one verdict (atomically; a cache_dir that cannot be written is left alone)."""
    memo = read(cache_dir)
    memo.setdefault(slot, {})[entry] = verdict
    p = path(cache_dir)
    tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(memo, indent=1, sort_keys=True))
        os.replace(tmp, p)
    except OSError:
        tmp.unlink(missing_ok=True)


def judged(cache_dir, slot: str, entry: str, judge) -> str | None:
    """`entry`'s remembered verdict under `slot`, or judge() once, remembered (no cache_dir: judge)."""
    if not isinstance(cache_dir, str) or not cache_dir.strip():
        return judge()
    memo = read(cache_dir).get(slot, {})
    if entry in memo:
        return memo[entry]
    verdict = judge()
    remember(cache_dir, slot, entry, verdict)
    return verdict
