#!/usr/bin/env bash
# Create/reuse .venv-engines: SGLang's and vLLM's own model classes and loaders for `verify`, on CPU.
# One virtualenv holds both engines, on the same CPU torch 2.13.0 as .venv (requirements-engines.txt says why
# each pin is what it is). It is apart from .venv because sglang 0.5.23 pins transformers 5.19 (.venv: 5.17,
# as on the GPU image). Installed in one `pip install --no-deps -r` of a complete lock: no resolver runs, so
# neither engine can pull in a CUDA torch. Safe to interrupt: running it again repairs it (scripts/setup_lib.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_lib.sh
VENV=${VENV:-.venv-engines}
check_python
want=$(cat requirements-engines.txt scripts/setup_engines.sh scripts/setup_lib.sh | sha256sum | cut -c1-16)
if venv_begin "$VENV" "$want"; then
  check_disk 5000
  pip="$VENV/bin/python -m pip -q --disable-pip-version-check"
  step "create $VENV" "'$PY -m venv' failed: on Debian/Ubuntu install python3.11-venv" "$PY" -m venv "$VENV"
  step "upgrade pip" "$NET_HINT" $pip install --upgrade pip
  step "sglang 0.5.23 + vllm 0.33.0 on CPU torch 2.13.0 (requirements-engines.txt, --no-deps)" "$NET_HINT" \
    $pip install --no-deps -r requirements-engines.txt
  step "import both engines" "the engines do not import in $VENV (message above): remove $VENV and run the same command again" \
    env VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import sglang, vllm, torch, triton; assert (sglang.__version__, vllm.__version__) == ('0.5.23', '0.33.0'), (sglang.__version__, vllm.__version__); assert torch.__version__.startswith('2.13.0')"
  venv_done
fi
