#!/usr/bin/env bash
# GPU-box wrapper for scripts/bench/sglang_serving.py (issue #10): the +experiment=gpu_smollm2 chain in the
# background, then real SGLang servers case by case. Run from the repo root on the H200, after the bundles
# (.gpu/install.sh, .gpu-sgl/install.sh) are installed:
#   bash scripts/bench/sglang_serving.sh start-chain        # prepare..export in its own session, then offline tau
#   bash scripts/bench/sglang_serving.sh wait FILE SECONDS  # until /tmp/sglserve/FILE exists (or the chain failed)
#   bash scripts/bench/sglang_serving.sh serve BUDGET CASE...   # scripts/bench/sglang_serving.py, resumable
#   bash scripts/bench/sglang_serving.sh collect            # results and logs into $OUT
set -u
W=/tmp/sglserve; R=/tmp/gpurun; mkdir -p $W
A="+experiment=gpu_smollm2 target.path=/tmp/model/smol.gguf cache_dir=/tmp/epcache run_dir=$R \
export.verify_in_engine=false train.wandb.mode=disabled eval.max_draft=3 export.serve.sglang_args=[--attention-backend,triton]"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
case "$1" in
  chain)
    for s in prepare extract vocab train export; do
      echo "=== $s $(date +%T)"; python3 -m pipeline $A stage=$s || { echo "CHAIN FAILED at $s"; touch $W/chain.failed; exit 1; }
    done
    echo "=== export done $(date +%T)"; touch $W/export.done
    # offline tau once the good export's throughput is measured (that wants the GPU to itself)
    for i in $(seq 1 180); do [ -f $W/good.json ] && break; sleep 5; done
    echo "=== evaluate (offline) $(date +%T)"; python3 -m pipeline $A stage=evaluate && touch $W/offline.done
    echo "=== chain done $(date +%T)";;
  start-chain)
    setsid bash "$0" chain > $W/chain.log 2>&1 < /dev/null & echo "chain pgid $!"; echo $! > $W/chain.pgid;;
  wait)
    for i in $(seq 1 $(( $3 / 5 ))); do [ -f $W/$2 ] || [ -f $W/chain.failed ] && break; sleep 5; done
    ls $W; grep -E "^===|CHAIN|stage .*done|Error|error" $W/chain.log | tail -15;;
  serve)
    b=$2; shift 2; python3 scripts/bench/sglang_serving.py --budget $b "$@";;
  collect)
    [ -n "${OUT:-}" ] || exit 0
    cp $W/sglang_serving.json $OUT/ 2>/dev/null; cp $W/chain.log $OUT/ 2>/dev/null
    cp $R/eval/acceptance.json $OUT/ 2>/dev/null
    tar czf $OUT/logs.tgz --ignore-failed-read $W/*.log $W/*.json $W/verify017* $R/stages.json $R/export/sglang/serve.sh \
      $R/export/sglang/config.json $R/export/sglang/export_manifest.json $R/eval/*.json $R/summary.md 2>/dev/null
    nvidia-smi --query-gpu=memory.used --format=csv > $OUT/gpu_mem.txt 2>&1; ls -la $OUT;;
esac
