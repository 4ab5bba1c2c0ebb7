"""What every benchmark's JSON starts with (bench name, date, machine, the command that ran) and where it goes ($OUT,
else the script's default folder): one home for both, so the results in scripts/bench/results/ read alike."""

import json
import os
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path


def commit() -> str:
    """The commit the code is at: $COMMIT (a device copy of the tree has no .git), else git's HEAD."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    r = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(Path(__file__).parent), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (r.stdout.strip() + ("+uncommitted" if dirty else "")) if r.returncode == 0 else "unknown"


def header(bench: str, **extra) -> dict:
    """The fields every result carries, then the script's own (versions, sizes, ...)."""
    return {"bench": bench, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(), "cpus": os.cpu_count(), "commit": commit(),
            "command": " ".join(["python", sys.argv[0], *sys.argv[1:]]), **extra}


def write(res: dict, name: str, default: str | Path = ".") -> Path:
    """Writes RES as NAME.json into $OUT (what a device run brings back), else DEFAULT; returns the path."""
    out = Path(os.environ.get("OUT") or default)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    return path
