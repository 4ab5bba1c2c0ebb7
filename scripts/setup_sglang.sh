#!/usr/bin/env bash
# Create/reuse .venv-sglang: the engine's own classes (sglang 0.5.23) for `verify`, on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-sglang/bin/python ] || "$PY" -m venv .venv-sglang
stamp=.venv-sglang/.eaglepipe-deps
want=$(cat requirements-sglang.txt scripts/setup_sglang.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv-sglang/bin/python -m pip install -q --upgrade pip
  .venv-sglang/bin/python -m pip install -q torch==2.14.1
  .venv-sglang/bin/python -m pip install -q --no-deps -r requirements-sglang.txt
  .venv-sglang/bin/python -m pip install -q --no-deps sglang==0.5.23
  .venv-sglang/bin/python -c "import sglang, torch; assert sglang.__version__ == '0.5.23' and torch.__version__.startswith('2.14.1')"
  echo "$want" > "$stamp"
fi
