"""Benchmark (GPU): our train loop vs speculators' own Trainer, same data, same draft config, same GPU.

Both train the same Eagle3DraftModel (same seed, same initial weights) on the same packed batches from the
feature store for the same number of optimizer steps (eager loss, bf16 autocast, AdamW, warmup + cosine),
then both drafts are scored by one evaluation function on the same held-out samples (acc per TTT step).
Usage:  python scripts/bench/train_vs_speculators.py target=smollm2 target.path=/tmp/model/smol.gguf \
          cache_dir=/tmp/epcache run_dir=/tmp/tb data.limit=1500 train.max_steps=200
BENCH_ONLY=ours|speculators: one trainer per process (torch.compile caches are per process); BENCH_SPEC_PAD=1:
speculators on our fixed-shape packs. Writes bench_train_{BENCH_ONLY}.json (bench_json: $OUT, else run_dir).
"""

import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import bench_json
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.config import register  # noqa: E402
from pipeline.data.features_dataset import PackDataset, collate, plan_packs, split  # noqa: E402
from pipeline.models import draft, targets  # noqa: E402
from pipeline.runner import run_stages  # noqa: E402
from pipeline.stages import train  # noqa: E402
from pipeline.training.loop import summarise  # noqa: E402
from pipeline.training.setup import load_inputs, pad_packs, split_context  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # speculators' Trainer itself needs CUDA


@torch.no_grad()
def evaluate(model, store, packs, cfg, fwd):
    model.eval()
    sums = defaultdict(float)
    for pack in packs:
        # the packs' shape as ours trains them (padded on CUDA): unpadded, dynamo's graph would turn dynamic
        pad = pad_packs(cfg.train, torch.device(DEV))
        batch = {k: v.to(DEV) for k, v in collate(store, pack, cfg.train.tokens_per_pack, pad).items()}
        if DEV == "cpu":  # no autocast on CPU: run fp32 like the CPU training path
            batch = {k: v.float() if v.is_floating_point() else v for k, v in batch.items()}
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=DEV == "cuda"):
            _, _, m = model(**batch, **fwd)
        for k, v in m.items():
            sums[k] += float(v)
    return summarise(sums, cfg.train.ttt_steps)


class SpecBatches(torch.utils.data.Dataset):
    """Our packs in the dict form speculators' Trainer consumes (plus its `error_records` count)."""

    def __init__(self, packs: PackDataset):
        self.packs = packs

    def __len__(self):
        return len(self.packs)

    def __getitem__(self, k):
        return {**self.packs[k], "error_records": 0}


def main(overrides):
    from speculators.losses.utils import resolve_loss_config

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["train.wandb.mode=disabled", *overrides])
    for stage in ("prepare", "extract", "vocab"):
        cfg.stage = stage
        run_stages(cfg)
    store, d2t, t2d, _ = load_inputs(cfg)
    t = cfg.train
    lengths = store.sample_lengths()
    train_idx, val_idx = split(len(lengths), t.val_fraction, cfg.seed)
    ctx = split_context(t)
    packs = plan_packs(train_idx, lengths, t.tokens_per_pack, cfg.seed, 0, context=ctx)
    val_packs = plan_packs(val_idx, lengths, t.tokens_per_pack, cfg.seed, 0, shuffle=False, context=ctx)
    steps = min(len(packs), t.max_steps or len(packs))
    tokens = sum(
        min(int(lengths[i]) - 1 - start, t.tokens_per_pack) for p in packs[:steps] for i, start, _ in p
    )
    fwd = dict(ttt_steps=t.ttt_steps, ttt_step_loss_decay=t.ttt_step_loss_decay)
    fwd["loss_config"] = resolve_loss_config(t.loss, "eager")
    folder = Path(store.facts["target_path"])
    target_hf = targets.load_config(folder, cfg.target)
    res = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "steps": steps}
    res |= {"tokens": tokens, "tokens_per_pack": t.tokens_per_pack}
    res |= {"train_samples": len(train_idx), "val_samples": len(val_idx)}

    def fresh():
        torch.manual_seed(cfg.seed)
        aux = store.aux_layer_ids
        return draft.build(folder, target_hf, aux, d2t, t2d, t.ttt_steps, t.attn_implementation)

    only = os.environ.get("BENCH_ONLY", "both")  # each in its own process: compile caches are per process
    res["untrained"] = evaluate(fresh().to(DEV), store, val_packs, cfg, fwd)  # also warms compile for both
    if only in ("both", "ours"):
        _ours(cfg, res, fresh, store, val_packs, fwd)
    if only in ("both", "speculators"):
        _speculators(cfg, res, fresh, store, packs, val_packs, fwd, steps)
    bench_json.write(bench_json.header(f"bench_train_{only}", **res), f"bench_train_{only}", cfg.run_dir)
    print(json.dumps({k: v for k, v in res.items() if k.startswith(("untrained", "ours", "speculators"))}))


def _ours(cfg, res, fresh, store, val_packs, fwd):
    """The real stage (accelerate, bf16 mixed precision)."""
    steps = res["steps"]
    cfg.stage, cfg.train.max_steps, cfg.train.val_every_steps = "train", steps, 10**9
    cfg.train.save_every_steps, cfg.train.resume = 10**9, "never"
    t0 = time.time()
    train.run(cfg)
    res["ours_wall_s"] = time.time() - t0
    res["ours_pad_packs"] = pad_packs(cfg.train, torch.device(DEV))
    res["ours_loss_chunk_tokens"] = cfg.train.loss_chunk_tokens
    rows = [json.loads(x) for x in (Path(cfg.run_dir) / "train" / "metrics.jsonl").read_text().splitlines()]
    loop = [r for r in rows if r["split"] == "train"]
    res["ours_tokens_per_s_logged"] = sum(r["tokens_per_s"] for r in loop[1:]) / max(len(loop) - 1, 1)
    # the loop from its first step to its last (compilation included), what speculators_wall_s times;
    # ours_wall_s is the whole stage (store, draft build, loader workers, final validation, checkpoint)
    res["ours_loop_wall_s"] = loop[-1]["wall_s"]
    res["ours_adam_betas"] = list(cfg.train.adam_betas)
    ours = fresh()
    final = Path(cfg.run_dir) / "train" / "final" / "model.safetensors"
    ours.load_state_dict(load_file(str(final)), strict=False)
    res["ours"] = evaluate(ours.to(DEV), store, val_packs, cfg, fwd)


def _speculators(cfg, res, fresh, store, packs, val_packs, fwd, steps):
    """speculators' own Trainer on the same packs, same initial weights, same number of steps."""
    from speculators.train.trainer import Trainer, TrainerConfig

    t = cfg.train
    if DEV != "cuda":
        print("no CUDA: speculators' Trainer hard-codes a CUDA device; skipped", json.dumps(res, indent=1))
        return
    model = fresh()
    pad = os.environ.get("BENCH_SPEC_PAD") == "1"  # on our fixed-shape packs too (isolates the padding)
    res["speculators_pad_packs"] = pad
    batches = SpecBatches(PackDataset(store.root, packs[:steps], t.tokens_per_pack, pad))
    loader = torch.utils.data.DataLoader(batches, batch_size=None, num_workers=t.num_workers)
    kw = {"lr": t.lr, "num_epochs": 1, "save_path": tempfile.mkdtemp(), "train_call_kwargs": fwd}
    kw |= {"val_call_kwargs": fwd, "weight_decay": t.weight_decay, "scheduler_type": "cosine"}
    kw |= {"scheduler_warmup_steps": t.warmup_steps, "max_steps": steps, "log_freq": 10**9}
    spec_cfg = TrainerConfig(**kw)
    trainer = Trainer(model, spec_cfg, loader, None)
    torch.cuda.synchronize()
    t0 = time.time()
    trainer.run_training()
    torch.cuda.synchronize()
    res["speculators_wall_s"] = time.time() - t0
    res["speculators"] = evaluate(model, store, val_packs, cfg, fwd)


if __name__ == "__main__":
    main(sys.argv[1:])
