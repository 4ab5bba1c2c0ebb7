#!/usr/bin/env bash
# Issue #31 on the H200: `+experiment=gpu_smollm2_large` from scratch (prepare -> evaluate, timed as one command),
# then the export served by SGLang with CUDA graphs on, beside a plain graphs-on server of the same target, through
# eaglepipe's own online bench (eval.concurrency 1 / 8 / 32, repeats). Issue #36 reads the same serving figures.
# Run from the repo root on the GPU box, after both bundles are installed (.gpu/install.sh, .gpu-sgl/install.sh):
#   bash scripts/bench/recipe_large.sh start          # the plan in its own session (setsid); returns at once
#   bash scripts/bench/recipe_large.sh wait SECONDS   # until the plan is done or failed, or SECONDS passed
#   bash scripts/bench/recipe_large.sh collect        # results JSON + logs into $OUT
# The plan's state lives in /tmp/recipe_large (the machine's /tmp lives while it is warm). SERVE=0: the chain only.
# Device time measured on 2026-12-03 (BENCHMARKS.md, "Ten times the data"): the five bundle calls and the plan's start
# took 158 s; SGLang's start 140 s; regeneration of 21,844 requests 689 s with the client of then (one shared httpx
# client; fixed since). Budget the rest from BENCHMARKS' rates: extract ~87K tokens/s, train TTT 5 ~60K tokens/s.
set -u
W=/tmp/recipe_large; R=$W/run; mkdir -p $W
SGL_PATH="/tmp/sgl-site:/tmp/site:$PWD"
# the bundle's SGLang has no FA3 (triton attention) and lives in /tmp/sgl-site, first on its servers' path only
A="+experiment=gpu_smollm2_large target.path=/tmp/model/smol.gguf cache_dir=/tmp/epcache run_dir=$R \
prepare.regenerate_server.args=[--attention-backend,triton] +prepare.regenerate_server.env.PYTHONPATH=$SGL_PATH \
export.serve.sglang_args=[--attention-backend,triton] ${EXTRA:-}"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
step() { echo "=== $1 $(date +%T)"; }
# serve.sh says `python`; the image may only have python3
mkdir -p /tmp/pybin; command -v python >/dev/null || ln -sf "$(command -v python3)" /tmp/pybin/python
export PATH=/tmp/pybin:$PATH

start_server() {  # NAME PORT LINE: in its own session; the pgid goes to $W/NAME.pgid; waits for /health
  local name=$1 port=$2 line=$3 t0; t0=$(date +%s)
  PYTHONPATH=$SGL_PATH setsid bash -c "$line" > $W/$name.log 2>&1 < /dev/null & echo $! > $W/$name.pgid
  for i in $(seq 1 150); do
    curl -sf http://127.0.0.1:$port/health > /dev/null 2>&1 && { echo "$name up in $(( $(date +%s) - t0 )) s"; return 0; }
    kill -0 "$(cat $W/$name.pgid)" 2>/dev/null || break; sleep 2
  done
  echo "$name DID NOT START"; tail -15 $W/$name.log; return 1
}
stop_server() { [ -f $W/$1.pgid ] && kill -- -"$(cat $W/$1.pgid)" 2>/dev/null; rm -f $W/$1.pgid; sleep 3; }

case "$1" in
  plan)
    ( peak=0; while :; do s=$(du -sb $R /tmp/epcache 2>/dev/null | awk '{t+=$1} END {print t+0}')
        [ "$s" -gt "$peak" ] && { peak=$s; echo $peak > $W/disk_peak_bytes; }; sleep 5; done ) & SAMPLER=$!
    step chain; t0=$(date +%s.%N)
    python3 -m pipeline stage=all $A > $W/chain.log 2>&1; rc=$?
    t1=$(date +%s.%N); kill $SAMPLER 2>/dev/null
    echo "{\"rc\": $rc, \"wall_s\": $(echo "$t1 - $t0" | bc), \"command\": \"python3 -m pipeline stage=all $A\"}" > $W/chain.json
    grep -aE "stage .*done|error|Error" $W/chain.log | tail -12
    [ $rc -eq 0 ] || { echo "CHAIN FAILED rc=$rc"; tail -20 $W/chain.log; touch $W/failed; exit 1; }
    touch $W/chain.done
    # the offline figures first: a device lease that ends during serving still brings them back (collect)
    python3 scripts/bench/recipe_large_report.py $W "bash scripts/bench/recipe_large.sh start" > $W/report_offline.log 2>&1
    [ "${SERVE:-1}" = 1 ] || { touch $W/done; step "done (SERVE=0: no serving)"; exit 0; }
    T=$(python3 -c "import json; print(json.load(open('$R/features/manifest.json'))['facts']['target_path'])")
    step serve-baseline
    start_server base 30001 "python -m sglang.launch_server --model-path $T --dtype bfloat16 --attention-backend triton \
      --port 30001 --mem-fraction-static 0.3 --served-model-name smollm2" || { touch $W/failed; exit 1; }
    step serve-speculative
    start_server spec 30000 "$(cat $R/export/sglang/serve.sh) --port 30000 --mem-fraction-static 0.4" \
      || { stop_server base; touch $W/failed; exit 1; }
    step online-bench
    python3 -m pipeline stage=evaluate $A eval.endpoint=http://127.0.0.1:30000 eval.baseline_endpoint=http://127.0.0.1:30001 \
      ${ONLINE:-eval.concurrency=[1,8,32] eval.repeats=3} > $W/online.log 2>&1 || { echo "ONLINE BENCH FAILED"; tail -20 $W/online.log; }
    grep -a "cuda graph" $W/spec.log | tail -2
    stop_server spec; stop_server base
    step report; python3 scripts/bench/recipe_large_report.py $W "bash scripts/bench/recipe_large.sh start"
    touch $W/done; step done;;
  start)
    # the plan runs from its own copy of the tree: a later device call re-sends the working tree under it
    # (COMMIT=...: the commit the sent tree is, where the device copy has no .git)
    rm -rf $W/code; mkdir -p $W/code; tar --exclude=./.gpu --exclude=./.gpu-sgl --exclude=./.git --exclude=./.venv \
      --exclude=./.venv-engines --exclude=./runs -cf - . | tar -C $W/code -xf -
    echo "${COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" > $W/code/COMMIT
    rm -f $W/done $W/failed; (cd $W/code && setsid bash scripts/bench/recipe_large.sh plan > $W/plan.log 2>&1 < /dev/null & echo $! > $W/plan.pgid)
    echo "plan pgid $(cat $W/plan.pgid)";;
  wait)
    for i in $(seq 1 $(( $2 / 5 ))); do { [ -f $W/done ] || [ -f $W/failed ]; } && break; sleep 5; done
    cat $W/plan.log; ls $R 2>/dev/null; tail -3 $W/chain.log 2>/dev/null; df -h /tmp | tail -1;;
  collect)
    [ -n "${OUT:-}" ] || exit 0
    cp $W/recipe_large_h200.json $OUT/ 2>/dev/null
    tar czf $OUT/recipe_large_logs.tgz --ignore-failed-read $W/*.log $W/*.json $R/stages.json $R/prepared/stats.json \
      $R/eval/*.json $R/eval/*/*.json $R/train/final/train_summary.json $R/train/metrics.jsonl $R/export/sglang/serve.sh \
      $R/export/sglang/export_manifest.json $R/summary.md 2>/dev/null; ls -la $OUT;;
esac
