#!/usr/bin/env bash
# GPU plan for issue #18 (device kind nvidia-h200-x2: 2 H200s of one host). After .gpu/install.sh (both parts) and,
# for part 1, .gpu-sgl/install.sh, from the repo root:
#   bash scripts/bench/two_gpu.sh start ; bash scripts/bench/two_gpu.sh wait SECONDS   (repeat wait until done)
# Every job has the GPUs to itself, one after the other. All inputs come from one prepare (no regeneration).
#  1. SGLang capture, TP 1 vs TP 2 (torchrun, rank 0 writes): the same store layout, parity of TP 2's states against
#     TP 1's (pipeline.tools.parity.compare: per-layer relative error; one GPU's hf-vs-sglang bf16 bound was a mean
#     of 0.006-0.022), capture tokens/s.
#  2. hf capture, 1 vs 2 data-parallel ranks: the store byte-identical, tokens/s ratio (goal >= 1.9x).
#  3. Training, SmolLM2's draft: 1 GPU x grad_accum 2 vs 2 GPUs x 1 (DDP, the same global batch and packs): val
#     metrics, tokens/s ratio (goal >= 1.85x), peak memory beside `eaglepipe plan`'s.
#  4. Training, a Llama-3.1-8B-shaped draft (random-init target from its config, 400 conversations): 1 GPU DDP vs
#     2 GPUs FSDP (train.strategy=fsdp), the same; peak memory per GPU beside the plan's DDP and FSDP estimates.
# Results: $OUT/two_gpu.json (scripts/bench/results/two_gpu.json), the logs.
# SMOKE=1: parts 2 and 3 only, on the CPU (gloo, target=tiny): what can be checked before device time is spent.
set -u
G=${PLAN_DIR:-/tmp/two}; L=$G/logs; mkdir -p $L
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the device README: no multicast
if [ "${SMOKE:-0}" = 1 ]; then
  export PYTHONPATH=$PWD OMP_NUM_THREADS=1
  S=${TWO_ARGS:-"+experiment=tiny data.limit=48 extract.shard_tokens=2500 extract.batch_tokens=300 cache_dir=${CACHE:-/tmp/two-cache}"}
  T="train.max_steps=6 train.tokens_per_pack=256 train.device=cpu train.val_every_steps=1000 train.num_workers=0"
  ACC="python3 -m accelerate.commands.launch --cpu --num_processes 2"
else
  S=${TWO_ARGS:-"target=smollm2 target.path=/tmp/model/smol.gguf cache_dir=/tmp/epcache data.limit=1500 \
extract.batch_tokens=65536 extract.max_batch_size=256"}
  T="train.max_steps=200 train.tokens_per_pack=8192 train.pad_packs=true train.num_workers=4 train.wandb.mode=disabled"
  ACC="python3 -m accelerate.commands.launch --config_file conf/accelerate/ddp.yaml --num_processes 2"
fi
step() { echo "=== $1 $(date +%T)"; }
secs() { local ms=$(( ($(date +%s%N) - $1) / 1000000 )); printf '%d.%03d\n' $((ms / 1000)) $((ms % 1000)); }
ranks() {  # ranks N LOG ARGS...: one process, or N under torchrun; wall seconds into $G/LOG.s
  local n=$1 log=$2; shift 2; local t0=$(date +%s%N)
  if [ "$n" = 1 ]; then python3 -m pipeline $S "$@" > $L/$log.log 2>&1
  else python3 -m torch.distributed.run --standalone --nproc-per-node $n -m pipeline $S "$@" > $L/$log.log 2>&1; fi
  local rc=$?; secs $t0 > $G/$log.s
  [ $rc = 0 ] || { echo "FAILED $log (rc $rc)"; tail -5 $L/$log.log; }; return $rc
}
inputs() {  # inputs SRC DST NAME...: a run dir with SRC's folders copied in (as tests/integration/test_ranks.py)
  local src=$1 dst=$2 name; shift 2; rm -rf $dst; mkdir -p $dst
  for name in "$@"; do cp -r $src/$name $dst/; done
}
case "$1" in
  plan)
    step "prepare (once)"
    python3 -m pipeline $S run_dir=$G/base stage=prepare > $L/prepare.log 2>&1 || { tail -5 $L/prepare.log; touch $G/done; exit 1; }
    if [ "${SMOKE:-0}" != 1 ]; then
      step "1. SGLang capture, TP 1 then TP 2"
      if [ -f /tmp/sgl-site/.done ]; then
        for n in 1 2; do
          inputs $G/base $G/tp$n prepared
          PYTHONPATH=/tmp/sgl-site:$PYTHONPATH ranks $n tp$n stage=extract extract.backend=sglang \
            extract.sglang_attention_backend=triton extract.sglang_mem_fraction=0.5 run_dir=$G/tp$n; tail -2 $L/tp$n.log
        done
      else echo "no SGLang bundle in /tmp/sgl-site: part 1 not run"; fi
    fi
    step "2. hf capture, 1 rank then 2 data-parallel ranks"
    for n in 1 2; do inputs $G/base $G/dp$n prepared; ranks $n dp$n stage=extract extract.backend=hf run_dir=$G/dp$n; done
    step "3. training SmolLM2's draft: 1 GPU x grad_accum 2, then 2 GPUs (DDP) x 1"
    python3 -m pipeline $S run_dir=$G/dp1 stage=vocab > $L/vocab.log 2>&1
    for n in 1 2; do inputs $G/dp1 $G/t$n prepared features vocab; done
    t0=$(date +%s%N); python3 -m pipeline $S $T train.grad_accum=2 run_dir=$G/t1 stage=train > $L/t1.log 2>&1 \
      || tail -5 $L/t1.log; secs $t0 > $G/t1.s
    t0=$(date +%s%N); $ACC -m pipeline $S $T train.grad_accum=1 run_dir=$G/t2 stage=train > $L/t2.log 2>&1 \
      || tail -5 $L/t2.log; secs $t0 > $G/t2.s
    for n in 1 2; do python3 -m pipeline plan $S $T plan.world_size=$n 2>&1 | grep '^json:' | sed 's/^json: //' > $G/plan_t$n.json; done
    if [ "${SMOKE:-0}" != 1 ]; then
      step "4. training an 8B-shaped draft: 1 GPU (DDP) x grad_accum 2, then 2 GPUs (FSDP) x 1"
      smol=$(ls -d /tmp/epcache/targets/smollm2-* | head -1)
      python3 scripts/bench/make_random_target.py llama3_8b /tmp/l8b $smol 2>&1 | tail -1
      B="target=llama3_8b target.path=/tmp/l8b cache_dir=/tmp/epcache data.limit=400 extract.batch_tokens=32768 \
extract.max_batch_size=64"
      for s in prepare extract vocab; do python3 -m pipeline $B run_dir=$G/l8b stage=$s > $L/l8b.$s.log 2>&1 || tail -3 $L/l8b.$s.log; done
      T8="$T train.max_steps=40 train.val_every_steps=1000"
      for n in 1 2; do inputs $G/l8b $G/f$n prepared features vocab; done
      t0=$(date +%s%N); python3 -m pipeline $B $T8 train.grad_accum=2 run_dir=$G/f1 stage=train > $L/f1.log 2>&1 \
        || tail -5 $L/f1.log; secs $t0 > $G/f1.s
      t0=$(date +%s%N); python3 -m accelerate.commands.launch --config_file conf/accelerate/fsdp.yaml --num_processes 2 \
        -m pipeline $B $T8 train.strategy=fsdp train.grad_accum=1 run_dir=$G/f2 stage=train > $L/f2.log 2>&1 \
        || tail -5 $L/f2.log; secs $t0 > $G/f2.s
      python3 -m pipeline plan $B $T8 plan.world_size=1 2>&1 | grep '^json:' | sed 's/^json: //' > $G/plan_f1.json
      python3 -m pipeline plan $B $T8 plan.world_size=2 train.strategy=fsdp 2>&1 | grep '^json:' | sed 's/^json: //' > $G/plan_f2.json
      rm -rf /tmp/l8b
    fi
    step report; python3 scripts/bench/two_gpu_report.py $G $G/two_gpu.json "bash scripts/bench/two_gpu.sh start ($S)"
    step done; touch $G/done;;
  start)
    rm -f $G/done; setsid bash "$0" plan > $G/plan.log 2>&1 < /dev/null & echo "plan pgid $!";;
  wait)
    for i in $(seq 1 $(( $2 / 5 ))); do [ -f $G/done ] && break; sleep 5; done
    cat $G/plan.log
    if [ -n "${OUT:-}" ]; then
      [ -f $G/done ] || python3 scripts/bench/two_gpu_report.py $G $G/two_gpu.json "bash scripts/bench/two_gpu.sh start [partial]" > /dev/null 2>&1
      cp $G/two_gpu.json $OUT/ 2>/dev/null; tar czf $OUT/logs.tgz -C $G logs 2>/dev/null
    fi; true;;
esac
