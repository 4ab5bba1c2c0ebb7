"""The fresh-clone plan's logs (scripts/gpu/plans/fresh_clone.json) as fresh_clone.json: rc and wall time of
`make demo` and `make test` (the runner's), peak memory (/usr/bin/time -v), the virtualenvs' sizes, the demo's
stage seconds, pytest's summary line.  Usage: python3 scripts/bench/fresh_clone_report.py PLAN_DIR"""

import json
import platform
import re
import sys
from pathlib import Path

import bench_json


def main(d: Path) -> None:
    jobs = {j["name"]: j for j in json.loads((d / "state.json").read_text())["jobs"]}
    res = bench_json.header("fresh_clone", command="python3 scripts/gpu/plan.py start fresh_clone")
    res["machine"] = f"{res['cpus']} cores, {platform.machine()}, Python {platform.python_version()}"
    for name in ("demo", "test"):
        log = (d / "logs" / f"{name}.log").read_text(errors="replace")
        rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log)
        res[name] = {"rc": jobs[name]["rc"], "wall_s": jobs[name]["wall_s"]}
        res[name]["max_rss_mib"] = int(rss.group(1)) // 1024 if rss else None
    summary = re.findall(r"^=* ?(\d+ passed.*?) ?=*$", (d / "logs" / "test.log").read_text(), re.M)
    res["test"]["pytest_summary"] = summary[-1] if summary else None
    stages = json.loads(next((d / "clone" / "runs").glob("*/stages.json")).read_text())
    res["demo"]["stage_seconds"] = {k: v["seconds"] for k, v in stages.items()}
    res["demo"]["both_virtualenvs_built_s"] = jobs["setup"]["wall_s"]  # `make demo` builds them first
    res["demo"]["wall_s"] += jobs["setup"]["wall_s"]
    du = (d / "logs" / "du.log").read_text().split()
    res["disk_mib"] = {k: int(v) for v, k in zip(du[::2], du[1::2])}
    bench_json.write(res, "fresh_clone")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
