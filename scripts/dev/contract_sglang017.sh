#!/usr/bin/env bash
# The capture backend's contract suite (tests/engine_contract) against SGLang 0.5.17's REAL classes on CPU, beside
# CI's 0.5.23. 0.5.17 is the GPU bundle's release; its wheel is cp312 and pins torch 2.11, so it is not installed:
# its pure-Python sources are unzipped ahead of .venv-engines (python 3.11, CPU torch 2.13), with the
# transformers 5.12.1 it wants and a huggingface_hub 1.x (PyPI). Needs ../shared/gpu/sglang_bundle.sh's .gpu-sgl/.
# One local stub (only in this throwaway site): AutoImageProcessor.register is a no-op, since transformers
# 5.12.1 without torchvision raises on it and sglang 0.5.17's config modules call it at import.
#   bash scripts/dev/contract_sglang017.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
S=${SGL017_SITE:-/tmp/sgl017}; FIX=$S-fix
ls .gpu-sgl/s1/sglang-0.5.17-*.whl .gpu-sgl/s3/transformers-5.12.1-*.whl .gpu-sgl/s3/tokenizers-*.whl >/dev/null \
  || { echo "no .gpu-sgl bundle: run ../shared/gpu/sglang_bundle.sh first" >&2; exit 2; }
if [ ! -f "$S/.done" ]; then
  mkdir -p "$S" "$FIX"
  for w in .gpu-sgl/s1/sglang-0.5.17-*.whl .gpu-sgl/s3/transformers-5.12.1-*.whl .gpu-sgl/s3/tokenizers-*.whl; do
    unzip -q -o "$w" -d "$S"; done
  .venv/bin/python -m pip download -q --no-deps "huggingface_hub>=1.5,<2" -d "$S/dl"
  unzip -q -o "$S"/dl/huggingface_hub-*.whl -d "$S"
  cat > "$FIX/sitecustomize.py" <<'PY'
from transformers.utils import import_utils as _iu
_orig = _iu.DummyObject.__getattribute__
def _getattr(cls, key):
    return (lambda *a, **k: None) if key == "register" else _orig(cls, key)
_iu.DummyObject.__getattribute__ = _getattr
PY
  touch "$S/.done"
fi
folder() { .venv/bin/python -c "from pipeline.models import targets; from hydra import compose, initialize_config_dir; from pipeline.config import register
register()
with initialize_config_dir(config_dir='$PWD/conf', version_base='1.3'): c = compose('config', overrides=['target=$1', 'cache_dir=${EAGLEPIPE_CACHE:-$PWD/.cache/eaglepipe}'])
print(targets.resolve(c.target, c.cache_dir))" | tail -1; }
T=$(folder tiny); K=$(folder kimi_tiny)
EAGLEPIPE_CONTRACT_KIMI_TARGET=$K EAGLEPIPE_CONTRACT_TARGET=$T PYTHONPATH="$FIX:$S:$PWD" .venv-engines/bin/python -m pytest --noconftest -q -p no:cacheprovider \
  tests/engine_contract
