"""`make coverage`'s figures (#48): the suite's line and branch coverage of pipeline/ (every process it
started, combined), as scripts/bench/results/NAME.json (default `coverage`). Usage: [NAME]"""

import json
import subprocess
import sys
from pathlib import Path

from pipeline.formats import bench_results

ROOT = Path(__file__).resolve().parents[2]  # the repository


def main(name: str) -> None:
    cov = [sys.executable, "-m", "coverage"]
    subprocess.run([*cov, "combine", "-q"], cwd=ROOT, check=True)
    out = ROOT / ".coverage-data" / "report.json"  # not coverage.*: combine would read it as data
    subprocess.run([*cov, "json", "-q", "-o", str(out)], cwd=ROOT, check=True)
    t = json.loads(out.read_text())["totals"]
    res = bench_results.header(name, command="make coverage")
    res |= {
        "lines": {"covered": t["covered_lines"], "total": t["num_statements"]},
        "branches": {"covered": t["covered_branches"], "total": t["num_branches"]},
        "line_pct": round(100 * t["covered_lines"] / t["num_statements"], 2),
        "branch_pct": round(100 * t["covered_branches"] / max(t["num_branches"], 1), 2),
    }
    path = bench_results.write(res, name, ROOT / "scripts" / "bench" / "results")
    print(f"pipeline/: lines {res['line_pct']} %, branches {res['branch_pct']} % -> {path}")


def cli() -> None:
    main(sys.argv[1] if len(sys.argv) > 1 else "coverage")
