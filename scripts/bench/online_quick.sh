#!/usr/bin/env bash
# Short GPU plan (one H200, ~3 min): stage train under speculators' compiled forward with the default chunked loss
# (TTT 3), offline from a bf16 store vs train.features=online, same packs and steps, each alone on the GPU:
# tokens/s and peak memory (issue #16 item 3a; the fix of the loss under dynamo, #14). From the repo root, after
# .gpu/install.sh:  bash scripts/bench/online_quick.sh   -> $OUT/online_quick_h200.json
set -u
G=/tmp/q; mkdir -p $G/logs
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
A="target=smollm2 target.path=/tmp/model/smol.gguf cache_dir=/tmp/epcache data.limit=${LIMIT:-600} train.pad_packs=true \
train.tokens_per_pack=8192 train.num_workers=4 train.val_every_steps=1000 train.max_steps=${STEPS:-40} train.lr=6e-4 \
train.wandb.mode=disabled extract.batch_tokens=65536 extract.max_batch_size=256"
st() { echo "=== $1 $2 $(date +%T)"; python3 -m pipeline $A $3 run_dir=$G/$1 stage=$2 > $G/logs/$1.$2.log 2>&1 \
  || { echo "FAILED $1 $2"; grep -v "^ " $G/logs/$1.$2.log | tail -4; return 1; }; grep -h "stage $2: done\|train: val" $G/logs/$1.$2.log | sed 's/.*INFO\] - //'; }
st offline prepare "" && st offline extract "" && st offline vocab ""
mkdir -p $G/online && cp -r $G/offline/prepared $G/offline/stages.json $G/online/
st online vocab train.features=online
st offline train ""
st online train train.features=online
python3 scripts/bench/online_fp8_recipe_report.py $G ${OUT:-$G}/online_quick_h200.json "bash scripts/bench/online_quick.sh ($A)" | cut -c1-400
