#!/usr/bin/env bash
# A new user's first hour: clone HEAD into an empty folder (no .venv*, no converted target) and run the README's
# two commands there, timed. Writes scripts/bench/results/fresh_clone.json (BENCHMARKS.md "Fresh clone").
#   usage (from the repo root):  scripts/bench/fresh_clone.sh [/path/to/empty/dir]
# The converted target cache (~/.cache/eaglepipe) is moved aside for the run, so the demo builds it as a new
# machine would, and put back afterwards.
set -uo pipefail
repo=$(git rev-parse --show-toplevel)
dir=${1:-$(mktemp -d)/eaglepipe}
logs=$(mktemp -d)
[ -d ~/.cache/eaglepipe ] && mv ~/.cache/eaglepipe ~/.cache/eaglepipe.before-fresh-clone
git clone -q "$repo" "$dir"
cd "$dir"
date +%s > "$logs/demo_start"; /usr/bin/time -v make demo > "$logs/demo.log" 2>&1; echo $? > "$logs/demo_rc"
du -sm .venv .venv-engines runs > "$logs/du.txt"
date +%s > "$logs/test_start"; /usr/bin/time -v make test > "$logs/test.log" 2>&1; echo $? > "$logs/test_rc"
rm -rf ~/.cache/eaglepipe; [ -d ~/.cache/eaglepipe.before-fresh-clone ] && mv ~/.cache/eaglepipe.before-fresh-clone ~/.cache/eaglepipe
"$repo/.venv/bin/python" "$repo/scripts/bench/fresh_clone_report.py" "$logs" "$dir" > "$repo/scripts/bench/results/fresh_clone.json"
cat "$repo/scripts/bench/results/fresh_clone.json"
