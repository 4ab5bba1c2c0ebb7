"""What every benchmark's JSON starts with (bench, date, machine, commit, the command that ran) and where it
goes ($OUT, else the script's default folder): one home for both, so scripts/bench/results/ reads alike."""

import json
import os
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path


def commit() -> str:
    """The commit the code is at: $COMMIT (a device copy of the tree has no .git), else git's HEAD."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    git = ["git", "-C", str(Path(__file__).parent)]
    run = lambda *args: subprocess.run([*git, *args], capture_output=True, text=True)
    head, dirty = run("rev-parse", "--short", "HEAD"), run("status", "--porcelain", "--untracked-files=no")
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+uncommitted" if dirty.stdout.strip() else "")


def header(bench: str, **extra) -> dict:
    """The fields every result carries, then the script's own (versions, sizes, ...)."""
    now = datetime.now(UTC).isoformat(timespec="seconds")
    machine = {"host": socket.gethostname(), "cpus": os.cpu_count()}
    return {
        "bench": bench,
        "date": now,
        **machine,
        "commit": commit(),
        "command": " ".join(sys.argv),
        **extra,
    }


def write(res: dict, name: str, default: str | Path = ".") -> Path:
    """Writes RES as NAME.json into $OUT (what a device run brings back), else DEFAULT; returns the path."""
    out = Path(os.environ.get("OUT") or default)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    return out / f"{name}.json"


def read(path: Path) -> dict:
    """A JSON file a run wrote, or {} where there is none."""
    return json.loads(Path(path).read_text()) if Path(path).is_file() else {}
