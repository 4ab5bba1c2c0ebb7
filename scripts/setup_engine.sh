#!/usr/bin/env bash
# Create/reuse .venv-<engine>: an engine's own classes for `verify`, on CPU. Usage: setup_engine.sh sglang|vllm
# Each engine pins its own torch (2.14.x) and transformers, so each gets a virtualenv apart from .venv:
# torch first, then requirements-<engine>.txt with --no-deps (pip-freeze pins of what the engine imports to
# build its model class), then the engine itself with --no-deps (its full dependency set is CUDA kernels).
set -euo pipefail
cd "$(dirname "$0")/.."
engine=$1
case $engine in
  sglang) pkg=sglang==0.5.23 ;;
  vllm) pkg=vllm==0.33.0 ;;
  *) echo "setup_engine.sh: unknown engine $engine (sglang|vllm)" >&2; exit 2 ;;
esac
venv=.venv-$engine
PY=${PYTHON:-python3}
[ -x $venv/bin/python ] || "$PY" -m venv $venv
stamp=$venv/.eaglepipe-deps
want=$(cat requirements-$engine.txt scripts/setup_engine.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  $venv/bin/python -m pip install -q --upgrade pip
  $venv/bin/python -m pip install -q torch==2.14.1
  $venv/bin/python -m pip install -q --no-deps -r requirements-$engine.txt
  $venv/bin/python -m pip install -q --no-deps $pkg
  VLLM_TARGET_DEVICE=cpu $venv/bin/python -c "import $engine, torch; assert $engine.__version__ == '${pkg#*==}', $engine.__version__; assert torch.__version__.startswith('2.14.1')" 2>/dev/null
  echo "$want" > "$stamp"
fi
