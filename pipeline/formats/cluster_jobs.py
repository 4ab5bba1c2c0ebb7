"""run_dir/cluster/jobs.json: the SLURM jobs `eaglepipe submit` made for this run dir (issue #38).

One JSON object, rewritten whole (tmp + rename) after each submission:

    {"format": "eaglepipe-cluster-jobs", "schema_version": 1,
     "stages": {"extract": {"job_id": "15", "script": ".../cluster/extract.sbatch",
                            "log": ".../cluster/logs/extract-15.log", "ranks": 2, "after": "14",
                            "submitted_at": "2026-12-05T08:00:00"}, ...},
     "produced_by": {"eaglepipe": "0.x", "command": "..."}}

A stage's entry is its newest job; SLURM's own state of it is asked each time (squeue/scontrol), never stored.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from pipeline.errors import UserError

FORMAT, SCHEMA_VERSION = "eaglepipe-cluster-jobs", 1
FOLDER = "cluster"


def folder(run_dir: Path) -> Path:
    return Path(run_dir) / FOLDER


def path(run_dir: Path) -> Path:
    return folder(run_dir) / "jobs.json"


def log_path(run_dir: Path, stage: str) -> Path:
    """The log of a stage's job; SLURM fills in %j (the job id)."""
    return folder(run_dir) / "logs" / f"{stage}-%j.log"


def read(run_dir: Path) -> dict[str, dict]:
    """stage -> its newest job's entry; {} when nothing was submitted here."""
    p = path(run_dir)
    if not p.is_file():
        return {}
    try:
        body = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(
            f"{p} is damaged ({type(e).__name__}): cancel this run dir's jobs (squeue --me), delete it and "
            "submit again (up-to-date stages are not resubmitted)"
        ) from None
    if (
        not isinstance(body, dict)
        or body.get("format") != FORMAT
        or body.get("schema_version") != SCHEMA_VERSION
    ):
        raise UserError(f"{p}: not an {FORMAT} schema {SCHEMA_VERSION} file; delete it and submit again")
    return dict(body.get("stages") or {})


def write(run_dir: Path, stages: dict[str, dict], version: str) -> None:
    p = path(run_dir)
    p.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "stages": stages,
        "produced_by": {"eaglepipe": version, "command": " ".join(sys.argv), "at": time.strftime("%FT%T")},
    }
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
    os.replace(tmp, p)
