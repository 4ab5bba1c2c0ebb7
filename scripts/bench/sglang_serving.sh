#!/usr/bin/env bash
# GPU-box wrapper for scripts/bench/sglang_serving.py (issue #10): the +experiment=gpu_smollm2 chain in the
# background, then real SGLang servers case by case. Run from the repo root on the H200, after the bundles
# (.gpu/install.sh, .gpu-sgl/install.sh) are installed:
#   bash scripts/bench/sglang_serving.sh start-chain        # prepare..export in its own session, then offline tau
#   bash scripts/bench/sglang_serving.sh wait FILE SECONDS  # until /tmp/sglserve/FILE exists (or the chain failed)
#   bash scripts/bench/sglang_serving.sh serve BUDGET CASE...   # scripts/bench/sglang_serving.py, resumable
#   bash scripts/bench/sglang_serving.sh collect            # results and logs into $OUT
#   bash scripts/bench/sglang_serving.sh start-full         # issue #10's second plan (below), in its own session
#   bash scripts/bench/sglang_serving.sh capture            # capture through SGLang alone: parity, store, bench, tests/gpu
#   bash scripts/bench/sglang_serving.sh start-kimi         # issue #13: kimi_tiny chain + SGLang serving, in its own session
#   bash scripts/bench/sglang_serving.sh start-kimi2        # issue #13: the same with BOTH drafts (llama, mla) served
# `full`: a no-speculation server; prepare REGENERATES through it; parity hf vs sglang over the whole set;
# extract.backend=sglang; SGLang's capture vs its own prefill; vocab; train (beside it: tests/gpu and the
# same regeneration by local HF, for comparison); export; the export served (online vs baseline at
# concurrency 1 and 8, doctor); greedy-equality margins; CUDA-graph baseline; single_layer_fc.
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
  full)
    SGL="/tmp/sgl-site:/tmp/site:$PWD"; H=/tmp/hfrun; SX="extract.sglang_attention_backend=triton extract.sglang_mem_fraction=0.45"
    step() { echo "=== $1 $(date +%T)"; }
    T=$(python3 -c "import sys; from hydra import compose, initialize_config_dir; from pipeline.config import register; from pipeline.models import targets
register()
with initialize_config_dir(config_dir='$PWD/conf', version_base='1.3'): c = compose('config', overrides='$A'.split())
print(targets.resolve(c.target, c.cache_dir))" | tail -1); echo "target $T"
    SV="python3 scripts/bench/sglang_serving.py --budget 3000 --target $T --base-mem 0.25"
    step baseline; $SV baseline
    step prepare-through-sglang; python3 -m pipeline $A stage=prepare prepare.regenerate_endpoint=http://127.0.0.1:30001 \
      prepare.endpoint_concurrency=256 prepare.endpoint_timeout_s=600 || { echo "CHAIN FAILED at prepare"; touch $W/chain.failed; exit 1; }
    touch $W/prepare.done
    step parity; PYTHONPATH=$SGL python3 -m pipeline $A stage=parity extract.limit=500 $SX > $W/parity.log 2>&1; tail -8 $W/parity.log
    step extract-sglang; PYTHONPATH=$SGL python3 -m pipeline $A stage=extract extract.backend=sglang $SX > $W/extract.log 2>&1 \
      || { echo "extract sglang FAILED: hf instead"; tail -5 $W/extract.log; python3 -m pipeline $A stage=extract extract.overwrite=true; }
    grep -h "tokens written" $W/parity.log $W/extract.log
    step capture-bench; PYTHONPATH=$SGL python3 scripts/bench/sglang_capture_throughput.py $R $T triton 0.45 > $W/capbench.log 2>&1; tail -4 $W/capbench.log
    step vocab; python3 -m pipeline $A stage=vocab || { touch $W/chain.failed; exit 1; }
    (python3 -m pipeline $A run_dir=$H stage=prepare > $W/hfregen.log 2>&1; touch $W/hfregen.done) &
    (EAGLEPIPE_GPU_OVERRIDES="target.path=/tmp/model/smol.gguf extract.sglang_attention_backend=triton extract.sglang_mem_fraction=0.2" EAGLEPIPE_CACHE=/tmp/epcache \
      PYTHONPATH=$SGL python3 -m pytest -m requires_sglang_gpu tests/gpu -q -p no:cacheprovider > $W/testsgpu.log 2>&1; touch $W/testsgpu.done) &
    step train; python3 -m pipeline $A stage=train || { touch $W/chain.failed; exit 1; }
    step export; python3 -m pipeline $A stage=export || { touch $W/chain.failed; exit 1; }
    touch $W/export.done; tail -3 $W/testsgpu.log
    step serve; $SV baseline_generate good margins stop-baseline baseline_cg
    $SV single_layer_fc
    step hfregen-wait; for i in $(seq 1 60); do [ -f $W/hfregen.done ] && break; sleep 5; done
    python3 scripts/bench/compare_prepared.py $R $H > $W/compare_prepared.json 2>$W/compare_prepared.err; cat $W/compare_prepared.json | head -30
    touch $W/full.done; step done;;
  capture)
    # capture through SGLang alone (the part of `full` that failed on 2026-12-01): no regeneration, no server
    SGL="/tmp/sgl-site:/tmp/site:$PWD"; SX="extract.sglang_attention_backend=triton extract.sglang_mem_fraction=0.6"
    C="$A prepare.regenerate=false"
    echo "=== prepare $(date +%T)"; python3 -m pipeline $C stage=prepare || exit 1
    T=$(python3 -c "from hydra import compose, initialize_config_dir; from pipeline.config import register; from pipeline.models import targets
register()
with initialize_config_dir(config_dir='$PWD/conf', version_base='1.3'): c = compose('config', overrides='$C'.split())
print(targets.resolve(c.target, c.cache_dir))" | tail -1); echo "target $T"
    echo "=== probe $(date +%T)"; PYTHONPATH=$SGL timeout 240 python3 scripts/dev/sglang_capture_probe.py $T triton 0.6 > $W/probe.log 2>&1; grep -v "^\s*$" $W/probe.log | grep -E "^(max_|slot|==|   NO_COPY|Traceback|  File|[A-Za-z]*Error)" | tail -40
    echo "=== parity $(date +%T)"; PYTHONPATH=$SGL python3 -m pipeline $C stage=parity extract.limit=500 $SX > $W/parity.log 2>&1; tail -8 $W/parity.log
    echo "=== extract-sglang $(date +%T)"; PYTHONPATH=$SGL python3 -m pipeline $C stage=extract extract.backend=sglang $SX > $W/extract.log 2>&1; tail -3 $W/extract.log
    echo "=== capture-bench $(date +%T)"; PYTHONPATH=$SGL python3 scripts/bench/sglang_capture_throughput.py $R $T triton 0.6 > $W/capbench.log 2>&1; tail -12 $W/capbench.log
    echo "=== tests/gpu $(date +%T)"; EAGLEPIPE_GPU_OVERRIDES="target.path=/tmp/model/smol.gguf $SX" EAGLEPIPE_CACHE=/tmp/epcache \
      PYTHONPATH=$SGL python3 -m pytest -m requires_sglang_gpu tests/gpu -q -p no:cacheprovider 2>&1 | tail -5
    touch $W/capture.done;;
  kimi)
    # issue #13 on the GPU: target=kimi_tiny (DeepseekV3ForCausalLM, MLA + MoE) regenerates its own answers (HF),
    # parity hf vs sglang, extract through SGLang, train the Llama-layout draft, export, offline tau, then the
    # export served by SGLang with EAGLE3 (online accept length) beside a no-speculation server
    K=/tmp/kimirun; KW=/tmp/kimiserve; mkdir -p $KW; SGL="/tmp/sgl-site:/tmp/site:$PWD"
    SX="extract.sglang_attention_backend=triton extract.sglang_mem_fraction=0.5"
    KA="+experiment=gpu_smollm2 target=kimi_tiny cache_dir=/tmp/epcache run_dir=$K export.verify_in_engine=false \
train.wandb.mode=disabled eval.max_draft=3 export.serve.sglang_args=[--attention-backend,triton] data.limit=800 \
prepare.max_new_tokens=96 vocab.draft_vocab_size=256 train.epochs=4 eval.num_prompts=12 eval.max_new_tokens=48"
    step() { echo "=== kimi $1 $(date +%T)"; }
    [ "${KIMI_FROM:-}" = vocab ] || {  # KIMI_FROM=vocab: the store is there already (a second call)
    step prepare; python3 -m pipeline $KA stage=prepare > $KW/prepare.log 2>&1; tail -2 $KW/prepare.log
    step parity; PYTHONPATH=$SGL timeout 200 python3 -m pipeline $KA stage=parity extract.limit=300 $SX > $KW/parity.log 2>&1; grep -aE "parity:|tokens written|Error" $KW/parity.log | tail -8
    step extract-sglang; PYTHONPATH=$SGL timeout 200 python3 -m pipeline $KA stage=extract extract.backend=sglang $SX > $KW/extract.log 2>&1 \
      || { echo "extract sglang FAILED: hf instead"; grep -a Error $KW/extract.log | tail -3; python3 -m pipeline $KA stage=extract extract.overwrite=true > $KW/extract_hf.log 2>&1; }
    grep -ah "tokens written" $KW/extract*.log; }
    for s in vocab train export evaluate; do step $s; python3 -m pipeline $KA stage=$s > $KW/$s.log 2>&1 || { echo "$s FAILED"; tail -5 $KW/$s.log; }; done
    grep -a "tau" $KW/evaluate.log | tail -4
    T=$(python3 -c "import json; print(json.load(open('$K/features/manifest.json'))['facts']['target_path'])")
    step serve; python3 scripts/bench/sglang_serving.py --run-dir $K --work $KW --budget 260 --case-s 60 --target $T \
      --served-name kimi-tiny --overrides "$KA" --no-engine-check baseline good 2>&1 | tail -4
    python3 scripts/bench/sglang_serving.py --work $KW --run-dir $K stop-baseline > /dev/null 2>&1
    [ -n "${OUT:-}" ] && { cp $KW/*.json $K/parity/parity.json $K/eval/acceptance.json $OUT/ 2>/dev/null; \
      tar czf $OUT/kimi_logs.tgz --ignore-failed-read $KW/*.log $K/stages.json $K/export/sglang/config.json $K/export/sglang/serve.sh 2>/dev/null; }
    touch $W/kimi.done; step done;;
  kimi2)
    # issue #13, both drafts: one kimi_tiny store (HF regeneration, parity, SGLang capture), the Llama-layout and the
    # MLA draft trained side by side on it, each exported, evaluated offline and served by SGLang 0.5.17 with EAGLE3
    K=/tmp/kimirun; KM=/tmp/kimimla; KW=/tmp/kimiserve; mkdir -p $KW; SGL="/tmp/sgl-site:/tmp/site:$PWD"
    SX="extract.sglang_attention_backend=triton extract.sglang_mem_fraction=0.5"
    KA="+experiment=gpu_smollm2 target=kimi_tiny cache_dir=/tmp/epcache export.verify_in_engine=false \
train.wandb.mode=disabled eval.max_draft=3 export.serve.sglang_args=[--attention-backend,triton] data.limit=800 \
prepare.max_new_tokens=96 vocab.draft_vocab_size=256 train.epochs=4 eval.num_prompts=12 eval.max_new_tokens=48"
    KL="$KA run_dir=$K"; KMA="$KA run_dir=$KM train.draft_arch=mla export.engines=[sglang]"
    step() { echo "=== kimi2 $1 $(date +%T)"; }
    step prepare; python3 -m pipeline $KL stage=prepare > $KW/prepare.log 2>&1; tail -2 $KW/prepare.log
    step parity; PYTHONPATH=$SGL timeout 200 python3 -m pipeline $KL stage=parity extract.limit=300 $SX > $KW/parity.log 2>&1; grep -aE "parity:|tokens written|Error" $KW/parity.log | tail -8
    step extract-sglang; PYTHONPATH=$SGL timeout 200 python3 -m pipeline $KL stage=extract extract.backend=sglang $SX > $KW/extract.log 2>&1 \
      || { echo "extract sglang FAILED: hf instead"; grep -a Error $KW/extract.log | tail -3; python3 -m pipeline $KL stage=extract extract.overwrite=true > $KW/extract_hf.log 2>&1; }
    grep -ah "tokens written" $KW/extract*.log
    step vocab; python3 -m pipeline $KL stage=vocab > $KW/vocab.log 2>&1 || { echo "vocab FAILED"; tail -3 $KW/vocab.log; }
    rm -rf $KM; mkdir -p $KM; cp -r $K/prepared $K/features $K/vocab $K/stages.json $KM/
    T=$(python3 -c "import json; print(json.load(open('$K/features/manifest.json'))['facts']['target_path'])")
    step "train llama + mla side by side"
    python3 -m pipeline $KL stage=train > $KW/train.log 2>&1 & P1=$!
    ( python3 -m pipeline $KMA stage=train > $KW/train_mla.log 2>&1 || { echo "mla train failed compiled: eager"; \
      TORCHDYNAMO_DISABLE=1 python3 -m pipeline $KMA stage=train train.resume=never > $KW/train_mla_eager.log 2>&1; } ) & P2=$!
    # the no-speculation server meanwhile (the greedy reference and the online baseline)
    python3 scripts/bench/sglang_serving.py --run-dir $K --work $KW --budget 200 --case-s 60 --target $T \
      --served-name kimi-tiny --overrides "$KA" --base-mem 0.15 --no-engine-check baseline 2>&1 | tail -2
    wait $P1 $P2; grep -ah "val full_acc_0\|Error" $KW/train*.log | tail -4
    for d in "$KL" "$KMA"; do python3 -m pipeline $d stage=export > $KW/export_$(echo $d | grep -c mla).log 2>&1 || echo "export FAILED ($d)"; done
    step "evaluate both (offline) beside the llama draft's server"
    python3 -m pipeline $KL stage=evaluate > $KW/evaluate.log 2>&1 & E1=$!
    python3 -m pipeline $KMA stage=evaluate > $KW/evaluate_mla.log 2>&1 & E2=$!
    SV="python3 scripts/bench/sglang_serving.py --work $KW --budget 400 --case-s 60 --target $T --served-name kimi-tiny --eval-conc none --no-engine-check"
    step "serve llama"; $SV --run-dir $K --overrides "$KA" good 2>&1 | tail -2
    step "serve mla"; $SV --run-dir $KM --overrides "$KA train.draft_arch=mla export.engines=[sglang]" --tag _mla good 2>&1 | tail -2
    wait $E1 $E2; grep -a "^trained draft" $KW/evaluate*.log
    python3 scripts/bench/sglang_serving.py --work $KW --run-dir $K stop-baseline > /dev/null 2>&1
    [ -n "${OUT:-}" ] && { cp $KW/*.json $OUT/ 2>/dev/null; cp $K/parity/parity.json $OUT/ 2>/dev/null; \
      cp $K/eval/acceptance.json $OUT/acceptance_llama.json; cp $KM/eval/acceptance.json $OUT/acceptance_mla.json; \
      for r in $K $KM; do n=$(basename $r); cp $r/export/sglang/export_manifest.json $OUT/manifest_$n.json; \
        cp $r/train/final/train_summary.json $OUT/train_summary_$n.json; done; \
      tar czf $OUT/kimi2_logs.tgz --ignore-failed-read $KW/*.log $K/stages.json $KM/stages.json $K/export/sglang/config.json \
        $KM/export/sglang/config.json 2>/dev/null; }
    touch $W/kimi2.done; step done;;
  start-kimi2)
    rm -f $W/kimi2.done; setsid bash "$0" kimi2 >> $W/kimi2.log 2>&1 < /dev/null & echo "kimi2 pgid $!"; echo $! > $W/kimi2.pgid;;
  start-kimi)
    rm -f $W/kimi.done; setsid bash "$0" kimi >> $W/kimi.log 2>&1 < /dev/null & echo "kimi pgid $!"; echo $! > $W/kimi.pgid;;
  start-full)
    setsid bash "$0" full > $W/chain.log 2>&1 < /dev/null & echo "full pgid $!"; echo $! > $W/chain.pgid;;
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
    cp $R/eval/acceptance.json $R/bench_sglang_capture.json $R/parity/parity.json $W/compare_prepared.json $OUT/ 2>/dev/null
    tar czf $OUT/logs.tgz --ignore-failed-read $W/*.log $W/*.json $W/verify017* $R/stages.json $R/export/sglang/serve.sh \
      $R/export/sglang/config.json $R/export/sglang/export_manifest.json $R/eval/*.json $R/summary.md \
      $R/prepared/stats.json /tmp/hfrun/stages.json /tmp/hfrun/prepared/stats.json $R/train/final/train_summary.json 2>/dev/null
    nvidia-smi --query-gpu=memory.used --format=csv > $OUT/gpu_mem.txt 2>&1; ls -la $OUT;;
esac
