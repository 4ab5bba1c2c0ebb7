"""<cache_dir>/engine_reports/<key>.json, one home: the engine reports of exports already loaded into an
engine's own class (pipeline/engines/verify.py `engine_report`), so the same bytes in the same engine are not
loaded again. Loading starts a Python of the engines' virtualenv that imports SGLang or vLLM: 20-25 s of two
CPU cores for each engine, paid by every stage=export and `eaglepipe verify`, for the same answer.

A file per report, named by the key (the sha256 of everything the report depends on: verify.report_key):

    {"format": "eaglepipe-engine-report", "schema_version": 1, "key": "<sha256>",
     "made_at": "2026-12-07T01:50:00", "report": {...the engine's JSON report...}}

It is a cache: a missing, damaged or unwritable file only means the engine runs again."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

FORMAT, SCHEMA_VERSION = "eaglepipe-engine-report", 1
FOLDER = "engine_reports"


def path(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir) / FOLDER / f"{key}.json"


def read(cache_dir: str | Path, key: str) -> dict | None:
    """{"report", "made_at"} remembered for key, or None."""
    try:
        memo = json.loads(path(cache_dir, key).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(memo, dict) and memo.get("format") == FORMAT and memo.get("key") == key
    return memo if ok and isinstance(memo.get("report"), dict) else None


def remember(cache_dir: str | Path, key: str, report: dict) -> None:
    """Write one report (tmp + rename; a cache_dir that cannot be written is left alone)."""
    p = path(cache_dir, key)
    tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
    memo = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "key": key,
        "made_at": time.strftime("%FT%T"),
        "report": report,
    }
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(memo, indent=1))
        os.replace(tmp, p)
    except OSError:
        tmp.unlink(missing_ok=True)
