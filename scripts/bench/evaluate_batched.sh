#!/usr/bin/env bash
# GPU plan for scripts/bench/evaluate_batched.py (issue #14, item 3): a SmolLM2 chain cut short (1,000
# regenerated conversations, 2 epochs), then the serial vs batched offline bench on its export, then stage
# evaluate itself (batched) for its wall time. After .gpu/install.sh (both parts), from the repo root:
#   bash scripts/bench/evaluate_batched.sh start ; bash scripts/bench/evaluate_batched.sh wait SECONDS
set -u
W=/tmp/evb; mkdir -p $W
A="+experiment=gpu_smollm2 target.path=/tmp/model/smol.gguf cache_dir=/tmp/epcache run_dir=/tmp/evbrun data.limit=1000 \
train.epochs=2 export.engines=[sglang] eval.num_prompts=32 eval.max_new_tokens=64 eval.max_draft=5 eval.batch_size=32"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
case "$1" in
  plan)
    for s in prepare extract vocab train export; do
      echo "=== $s $(date +%T)"; python3 -m pipeline $A stage=$s > $W/$s.log 2>&1 || { echo "FAILED at $s"; tail -5 $W/$s.log; touch $W/done; exit 1; }
    done
    echo "=== bench $(date +%T)"; OUT=$W python3 scripts/bench/evaluate_batched.py $A 2>&1 | grep -v Loading | tail -8
    echo "=== stage evaluate $(date +%T)"; python3 -m pipeline $A stage=evaluate > $W/evaluate.log 2>&1; grep -A3 "^tau" $W/evaluate.log
    grep -h "stage .*done in" $W/*.log; cp /tmp/evbrun/stages.json /tmp/evbrun/eval/acceptance.json $W/ 2>/dev/null
    echo "=== done $(date +%T)"; touch $W/done;;
  start)
    rm -f $W/done; setsid bash "$0" plan > $W/plan.log 2>&1 < /dev/null & echo "plan pgid $!";;
  wait)
    for i in $(seq 1 $(( $2 / 5 ))); do [ -f $W/done ] && break; sleep 5; done
    cat $W/plan.log; [ -f $W/done ] && [ -n "${OUT:-}" ] && cp $W/*.json $W/*.txt $OUT/ 2>/dev/null; true;;
esac
