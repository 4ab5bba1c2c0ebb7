#!/usr/bin/env bash
# GPU plan (one H200) for issues #16 (online training, fp8 store), #17 (tau on standard sets, recipe levers)
# and #14 (what binds a training step). After .gpu/install.sh (both parts), from the repo root:
#   bash scripts/bench/online_fp8_recipe.sh start ; bash scripts/bench/online_fp8_recipe.sh wait SECONDS
# Phase 1: one regenerated SmolLM2 chitchat set (+experiment=gpu_smollm2), a bf16 store and an fp8 store.
# Phase 2, one job at a time on the GPU (throughput and peak memory are the job's own): 3-epoch drafts from the
#   bf16 store and online (no store); then a short profiled run on each store (scripts/bench/train_profile.py).
# Phase 3, concurrently: export + evaluate of those two; the 3-epoch fp8 draft, and two recipe variants (run dirs
#   ttt7, ttt7_e6; their overrides VARIANT_A / VARIANT_B, by default TTT 7, and TTT 7 for 6 epochs with tau probed
#   every epoch and select=tau: measured 2026-12-02), each ending in evaluate on heldout / MT-bench / HumanEval.
#   DATA_ARGS adds data overrides to every run, e.g. DATA_ARGS="data.limit=null" (all 4,017 usable chitchat
#   conversations, first 3 assistant turns: 10,221 turns to regenerate, 2x the default's 5,063; then an epoch is
#   ~156 steps and eval_tau_every_steps=78 probes every half epoch).
#   Next: VARIANT_A="train.epochs=6 train.eval_tau_every_steps=78" (TTT 3, 6 epochs, the same 80 prompts)
#         VARIANT_B="train.ttt_steps=7 train.epochs=6 train.lr=1e-3 train.eval_tau_every_steps=78 train.select=tau"
# scripts/bench/online_fp8_recipe_report.py gathers every run dir into one JSON.
set -u
G=${PLAN_DIR:-/tmp/g}; L=$G/logs; mkdir -p $L
A=${PLAN_ARGS:-"+experiment=gpu_smollm2 target.path=/tmp/model/smol.gguf cache_dir=/tmp/epcache prepare.gen_batch_size=512 \
train.pad_packs=true export.engines=[sglang] eval.sets=[heldout,mt_bench,mt_bench_turn2,humaneval] eval.num_prompts=80 eval.batch_size=40 ${DATA_ARGS:-}"}
declare -A V=([bf16]="" [fp8]="extract.store_dtype=fp8_e4m3" [online]="train.features=online"
              [ttt7]=${VARIANT_A:-"train.ttt_steps=7 train.eval_tau_every_steps=78"}
              [ttt7_e6]=${VARIANT_B:-"train.ttt_steps=7 train.epochs=6 train.eval_tau_every_steps=78 train.select=tau"})
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
st() {  # st RUN STAGE: one stage of one run dir, logged; a failure is reported and the plan goes on
  echo "=== $1 $2 $(date +%T)"
  python3 -m pipeline $A ${V[$1]} run_dir=$G/$1 stage=$2 > $L/$1.$2.log 2>&1 || { echo "FAILED $1 $2"; tail -4 $L/$1.$2.log; return 1; }
  grep -h "stage $2: done" $L/$1.$2.log | sed 's/.*INFO\] - //'
}
clone() { mkdir -p $G/$2 && (cd $G/$1 && tar cf - --exclude=./features --exclude=./train --exclude=./export --exclude=./eval .) | (cd $G/$2 && tar xf -); }
case "$1" in
  plan)
    st bf16 prepare && st bf16 extract && st bf16 vocab || { touch $G/done; exit 1; }
    for v in fp8 online ttt7 ttt7_e6 prof_bf16; do clone bf16 $v; done
    for v in ttt7 ttt7_e6 prof_bf16; do cp -r $G/bf16/features $G/$v/; done
    st fp8 extract; st fp8 vocab; st online vocab; st ttt7 vocab; st ttt7_e6 vocab
    clone fp8 prof_fp8; cp -r $G/fp8/features $G/prof_fp8/; V[prof_fp8]=${V[fp8]}; V[prof_bf16]=""
    for v in bf16 online; do st $v train; done               # phase 2: alone on the GPU
    for v in prof_bf16 prof_fp8; do                           # a short profiled run of each store
      echo "=== $v $(date +%T)"
      OUT=$G/$v PROFILE_SKIP=15 PROFILE_STEPS=10 python3 scripts/bench/train_profile.py $A ${V[$v]} run_dir=$G/$v \
        train.max_steps=30 > $L/$v.log 2>&1 || tail -5 $L/$v.log
      grep -E '"(step|wait)_s_mean|gpu_busy_fraction|step_fraction' $G/$v/train_profile.json
    done
    echo "=== phase 3 $(date +%T)"                             # phase 3: together
    for v in bf16 online; do (st $v export && st $v evaluate) & done
    for v in fp8 ttt7 ttt7_e6; do (st $v train && st $v export && st $v evaluate) & done
    wait
    python3 scripts/bench/online_fp8_recipe_report.py $G $G/online_fp8_recipe_h200.json "bash scripts/bench/online_fp8_recipe.sh start ($A)"
    echo "=== done $(date +%T)"; touch $G/done;;
  start)
    rm -f $G/done; setsid bash "$0" plan > $G/plan.log 2>&1 < /dev/null & echo "plan pgid $!";;
  report)
    python3 scripts/bench/online_fp8_recipe_report.py $G $G/online_fp8_recipe_h200.json "bash scripts/bench/online_fp8_recipe.sh start ($A) [partial]";;
  wait)
    for i in $(seq 1 $(( $2 / 5 ))); do [ -f $G/done ] && break; sleep 5; done
    cat $G/plan.log
    if [ -n "${OUT:-}" ]; then
      [ -f $G/done ] || bash "$0" report > /dev/null 2>&1
      cp $G/online_fp8_recipe_h200.json $OUT/; for v in prof_bf16 prof_fp8; do cp $G/$v/train_profile.txt $OUT/$v.txt; done 2>/dev/null
      tar czf $OUT/runs.tgz -C $G logs $(cd $G && ls -d */train/metrics.jsonl */stages.json */eval/*.json */eval/*/*.json \
        */train/final/train_summary.json 2>/dev/null) 2>/dev/null
    fi; true;;
esac
