"""The annex stays a tool: scripts/ small, BENCHMARKS.md a reference whose every cited results JSON exists
(and every results JSON is cited), and the plans name scripts that exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "scripts" / "bench" / "results"


def test_scripts_stay_under_1500_lines():
    files = [p for p in (ROOT / "scripts").rglob("*") if p.is_file() and p.suffix != ".json"]
    files = [p for p in files if "__pycache__" not in p.parts]  # bytecode is not source
    lines = sum(len(p.read_bytes().splitlines()) for p in files)
    assert lines <= 1500, f"scripts/ holds {lines} non-JSON lines (limit 1,500)"


def test_benchmarks_md_stays_a_reference():
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 300


def test_every_cited_results_json_exists_and_every_one_is_cited():
    """`NAME.json` in backticks: a results file that must exist; a JSON not measured yet is named plainly."""
    cited = set(re.findall(r"`([\w.-]+\.json)`", (ROOT / "BENCHMARKS.md").read_text()))
    present = {p.name for p in RESULTS.glob("*.json")}
    assert sorted(cited - present) == [], "cited in BENCHMARKS.md, not in scripts/bench/results/"
    assert sorted(present - cited) == [], "in scripts/bench/results/, cited by no table of BENCHMARKS.md"


def test_the_plans_name_scripts_that_exist():
    for plan in (ROOT / "scripts" / "gpu" / "plans").glob("*.json"):
        for path in re.findall(r"scripts/[\w/.-]+\.(?:py|sh)", plan.read_text()):
            assert (ROOT / path).is_file(), f"{plan.name} runs {path}, which does not exist"
