#!/usr/bin/env bash
# GPU plan (one H200) for issue #14's figures: extract (SmolLM2 and a random-init Llama-3.1-8B-shaped target),
# training MFU and peak memory of the 8B-shape draft, our loop vs speculators' Trainer (fixed-shape packs), and
# the batched vs serial offline evaluate. After .gpu/install.sh (both parts), from the repo root:
#   bash scripts/bench/perf_h200.sh start ; bash scripts/bench/perf_h200.sh wait SECONDS   (repeat wait until done)
#   (`start2`: the second plan, below: measured after the first ran on 2026-12-02)
# Results: $OUT/*.json (each bench's own JSON) and perf.log.
set -u
G=${PLAN_DIR:-/tmp/perf}; mkdir -p $G/out
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
S="target=smollm2 target.path=/tmp/model/smol.gguf cache_dir=/tmp/epcache"
step() { echo "=== $1 $(date +%T)"; }
case "$1" in
  plan)
    step "extract SmolLM2"
    mkdir -p $G/out/smol; OUT=$G/out/smol python3 scripts/bench/extract_throughput.py $S run_dir=$G/xs data.limit=1500 \
      extract.batch_tokens=65536 extract.max_batch_size=256 > $G/xs.log 2>&1; tail -12 $G/xs.log
    step "train MFU, 8B-shape draft"
    OUT=$G/out python3 scripts/bench/train_mfu.py --target llama3_8b --tokens 8192 16384 --ttt 7 --steps 8 --attn sdpa simple_flex_attention > $G/mfu.log 2>&1
    tail -4 $G/mfu.log
    step "extract 8B-shape"
    smol=$(ls -d /tmp/epcache/targets/smollm2-* | head -1)
    python3 scripts/bench/make_random_target.py llama3_8b /tmp/l8b $smol 2>&1 | tail -1
    mkdir -p $G/out/l8b
    OUT=$G/out/l8b python3 scripts/bench/extract_throughput.py target=llama3_8b target.path=/tmp/l8b cache_dir=/tmp/epcache \
      run_dir=$G/x8 data.limit=400 extract.batch_tokens=32768 extract.max_batch_size=64 > $G/x8.log 2>&1; tail -12 $G/x8.log
    rm -rf /tmp/l8b $G/x8/features
    A="$S cache_dir=/tmp/epcache run_dir=$G/tb data.limit=1500 train.max_steps=200 train.tokens_per_pack=8192 \
       extract.batch_tokens=65536 extract.max_batch_size=256 train.num_workers=4 train.pad_packs=true"
    for who in speculators ours; do
      step "train $who"; BENCH_ONLY=$who OUT=$G/out python3 scripts/bench/train_vs_speculators.py $A > $G/tb_$who.log 2>&1
      tail -4 $G/tb_$who.log
    done
    step "train speculators on fixed-shape packs"     # isolates what the padding alone gives speculators' Trainer
    mkdir -p $G/out/specpad; BENCH_SPEC_PAD=1 BENCH_ONLY=speculators OUT=$G/out/specpad \
      python3 scripts/bench/train_vs_speculators.py $A > $G/tb_specpad.log 2>&1; tail -4 $G/tb_specpad.log
    step done; touch $G/done;;
  plan2)
    # Second plan (after 2026-12-02c's run of `plan`): what binds extract (its writer: one process's zarr writes,
    # or the disk), the writer processes, the 8B-shape MFU rows lost to the flex crash, and our loop with
    # speculators' AdamW betas (the 1.6-point acc_0 gap) timed from its first step to its last.
    step "disk and /dev/shm"; df -h /tmp /dev/shm | tail -2
    dd if=/dev/zero of=/tmp/ddtest bs=16M count=256 oflag=direct 2>&1 | tail -1; rm -f /tmp/ddtest
    step "shard commit: this process vs writer processes, SmolLM2 width"
    for r in /tmp/sc /dev/shm/sc; do
      mkdir -p $G/out/sc_$(basename $(dirname $r)); OUT=$G/out/sc_$(basename $(dirname $r)) python3 scripts/bench/shard_commit.py \
        --tokens 262144 --procs 1 2 4 8 --root $r 2>&1 | tail -5
    done
    step "shard commit: zarr's concurrency, then longer chunks (what one chunk file costs), this process, /tmp"
    mkdir -p $G/out/sc_conc; OUT=$G/out/sc_conc python3 scripts/bench/shard_commit.py --tokens 262144 --procs 1 \
      --concurrency 10 32 128 --root /tmp/sc 2>&1 | tail -4
    for c in 2048 8192; do mkdir -p $G/out/sc_c$c; OUT=$G/out/sc_c$c python3 scripts/bench/shard_commit.py --tokens 262144 \
      --procs 1 --chunk-tokens $c --root /tmp/sc 2>&1 | tail -1; done
    step "extract SmolLM2 (w2/w4/w8 = writer processes)"
    mkdir -p $G/out/smol2; OUT=$G/out/smol2 python3 scripts/bench/extract_throughput.py $S run_dir=$G/xs data.limit=1500 \
      extract.batch_tokens=65536 extract.max_batch_size=256 > $G/xs2.log 2>&1; tail -14 $G/xs2.log
    step "train ours, speculators' AdamW betas"
    A="$S cache_dir=/tmp/epcache run_dir=$G/tb data.limit=1500 train.max_steps=200 train.tokens_per_pack=8192 \
       extract.batch_tokens=65536 extract.max_batch_size=256 train.num_workers=4 train.pad_packs=true"
    mkdir -p $G/out/betas; BENCH_ONLY=ours OUT=$G/out/betas python3 scripts/bench/train_vs_speculators.py $A \
      train.adam_betas=[0.9,0.999] > $G/tb_betas.log 2>&1; tail -5 $G/tb_betas.log
    step "train MFU, 8B-shape draft"
    OUT=$G/out python3 scripts/bench/train_mfu.py --target llama3_8b --tokens 8192 16384 --ttt 7 --steps 8 --attn sdpa simple_flex_attention > $G/mfu.log 2>&1
    tail -6 $G/mfu.log
    step "evaluate: serial vs batched, one k per pass and every k in one pass (its own short chain, ~6 min)"
    bash scripts/bench/evaluate_batched.sh plan > $G/evb.log 2>&1; tail -12 $G/evb.log
    step done; touch $G/done;;
  plan3)
    # Third plan, run by online_fp8_recipe.sh recipe2 after its SGLang step (2026-12-02d), each part alone on the GPU:
    # the 8B-shape MFU rows, the batched evaluate (one k per pass vs every k in one pass) on that plan's export
    # (EVB_ARGS: its overrides and run_dir), and our loop with speculators' AdamW betas.
    step "train MFU, 8B-shape draft"
    OUT=$G/out python3 scripts/bench/train_mfu.py --target llama3_8b --tokens 8192 16384 --ttt 7 --steps 8 --attn sdpa simple_flex_attention > $G/mfu.log 2>&1
    tail -6 $G/mfu.log
    step "evaluate: serial vs batched on the recipe's export (32 held-out prompts x 64 tokens, k = 1..5)"
    mkdir -p /tmp/evb; OUT=/tmp/evb python3 scripts/bench/evaluate_batched.py $EVB_ARGS eval.num_prompts=32 \
      eval.max_new_tokens=64 eval.max_draft=5 eval.batch_size=32 > $G/evb.log 2>&1; grep -v Loading $G/evb.log | tail -9
    step "train ours, speculators' AdamW betas"
    A="$S cache_dir=/tmp/epcache run_dir=$G/tb data.limit=1500 train.max_steps=200 train.tokens_per_pack=8192 \
       extract.batch_tokens=65536 extract.max_batch_size=256 train.num_workers=4 train.pad_packs=true"
    mkdir -p $G/out/betas; BENCH_ONLY=ours OUT=$G/out/betas python3 scripts/bench/train_vs_speculators.py $A \
      train.adam_betas=[0.9,0.999] > $G/tb_betas.log 2>&1; tail -5 $G/tb_betas.log
    step done; touch $G/done;;
  start2)
    rm -f $G/done; setsid bash "$0" plan2 > $G/perf.log 2>&1 < /dev/null & echo "plan pgid $!";;
  start)
    rm -f $G/done; setsid bash "$0" plan > $G/perf.log 2>&1 < /dev/null & echo "plan pgid $!";;
  wait)
    for i in $(seq 1 $(( $2 / 5 ))); do [ -f $G/done ] && break; sleep 5; done
    cat $G/perf.log
    if [ -n "${OUT:-}" ]; then
      cp $G/out/*.json $OUT/ 2>/dev/null; cp $G/out/smol/bench_extract.json $OUT/extract_smol.json 2>/dev/null
      cp $G/out/l8b/bench_extract.json $OUT/extract_l8b.json 2>/dev/null; cp $G/perf.log $OUT/ 2>/dev/null
      cp $G/out/specpad/bench_train_speculators.json $OUT/bench_train_speculators_padded.json 2>/dev/null
      cp $G/out/smol2/bench_extract.json $OUT/extract_smol_procs.json 2>/dev/null
      cp $G/out/betas/bench_train_ours.json $OUT/bench_train_ours_betas0999.json 2>/dev/null
      cp $G/out/sc_tmp/shard_commit.json $OUT/shard_commit_tmp.json 2>/dev/null
      cp $G/out/sc_shm/shard_commit.json $OUT/shard_commit_shm.json 2>/dev/null; cp $G/*.log $OUT/ 2>/dev/null
      for d in sc_conc sc_c2048 sc_c8192; do cp $G/out/$d/shard_commit.json $OUT/shard_commit_${d#sc_}.json 2>/dev/null; done
      cp /tmp/evb/*.json /tmp/evb/*.txt $OUT/ 2>/dev/null
    fi; true;;
esac
