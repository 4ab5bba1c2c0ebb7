"""Turn the logs of scripts/bench/fresh_clone.sh into its JSON: wall time and peak memory of `make demo` and
`make test` (from /usr/bin/time -v), the virtualenvs' sizes, the demo's per-stage seconds, the test counts."""

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path


def timed(log: str) -> dict:
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", log).group(1).split(":")
    seconds = sum(float(x) * 60 ** i for i, x in enumerate(reversed(wall)))
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", log).group(1))
    return {"wall_s": round(seconds, 1), "max_rss_mib": rss // 1024}


def main(logs: Path, clone: Path) -> dict:
    demo, test = (logs / "demo.log").read_text(), (logs / "test.log").read_text()
    sizes = dict(reversed(line.split()) for line in (logs / "du.txt").read_text().splitlines())
    stages = json.loads((clone / "runs" / "smollm2-135m-instruct-chitchat" / "stages.json").read_text())
    summary = [line for line in test.splitlines() if re.search(r"\d+ passed", line)]
    first_log = re.search(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+\]", demo, re.M).group(1)
    setup_s = time.mktime(time.strptime(first_log, "%Y-%m-%d %H:%M:%S")) - int((logs / "demo_start").read_text())
    commit = subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {
        "benchmark": "fresh_clone", "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, "
        f"{platform.machine()}, {platform.python_version()} (the dev machine = CI's kind)",
        "command": "git clone <repo> <new dir> && cd <new dir> && make demo && make test", "commit": commit,
        "notes": os.environ.get("FRESH_CLONE_NOTES", ""),
        "demo": {**timed(demo), "rc": int((logs / "demo_rc").read_text()),
                 "both_virtualenvs_built_s": round(setup_s),
                 "stage_seconds": {k: v["seconds"] for k, v in stages.items()}},
        "test": {**timed(test), "rc": int((logs / "test_rc").read_text()),
                 "pytest_summary": summary[-1].strip("= ") if summary else None},
        "disk_mib": {k: int(v) for k, v in sizes.items()},
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2])), indent=1))
