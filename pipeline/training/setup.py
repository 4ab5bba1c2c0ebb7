"""A training run built from its config: inputs, accelerator, data plan, draft, optimizer, scheduler;
the train knobs that shape the result (the stage's fingerprint) and those a checkpoint resumes across."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pipeline.capture import features
from pipeline.config_choices import Strategy
from pipeline.data.features_dataset import (
    plan_packs,
    shard_for_rank,
    split,
    split_counts,
)
from pipeline.errors import UserError
from pipeline.fingerprint import digest, shaping
from pipeline.formats import feature_store as fs
from pipeline.formats import prepared, vocab_map
from pipeline.formats.run_dir import RunDir
from pipeline.models import draft, fsdp, losses, targets
from pipeline.training import optimizers
from pipeline.training.session import Plan, Session

log = logging.getLogger(__name__)


# Knobs that cannot change what train makes (final/'s weights, metrics.jsonl, plots/): how data is prefetched,
# where metrics are mirrored, how a run gets to its end (resume is bit-identical) and which intermediate
# checkpoints exist. Left out of the fingerprint, so changing one never reruns training.
NOT_SHAPING = ("num_workers", "wandb", "resume", "keep_last", "save_every_steps")


# A checkpoint may also be resumed under another logging/validation cadence or device (train_config_hash).
# grad_accum: a checkpoint resumes on another number of ranks, where keeping ranks x grad_accum keeps the
# batch
RESUMABLE_ACROSS = NOT_SHAPING + (
    "log_every_steps",
    "val_every_steps",
    "device",
    "grad_accum",
    "eval_tau_every_steps",
    "select",
    "loss_chunk_tokens",
)


def split_context(t) -> int:
    return t.tokens_per_pack // 4 if t.split_context is None else t.split_context


def pad_packs(t, device: torch.device) -> bool:
    """train.pad_packs, with null resolved: padded to one shape where the forward is compiled (CUDA)."""
    return bool(t.pad_packs) if t.pad_packs is not None else device.type == "cuda"


def load_inputs(cfg):
    store = features.open_source(cfg)  # the feature store, or (train.features=online) the target itself
    try:
        d2t, t2d, vman = vocab_map.load(RunDir.of(cfg).vocab)
    except vocab_map.VocabError as e:
        raise UserError(f"{e}; run stage=vocab first") from None
    if vman["features_manifest_hash"] != store.manifest_hash():
        raise UserError(
            f"{cfg.run_dir}/vocab was built from other features than "
            f"{store.root or 'this run computes online (train.features=online)'}; rerun stage=vocab"
        )
    return store, d2t, t2d, vman


def make_accelerator(cfg):
    from accelerate import Accelerator

    t = cfg.train
    cpu = t.device == "cpu" or (t.device == "auto" and not torch.cuda.is_available())
    trackers = None
    if t.wandb.mode != "disabled":
        try:
            import wandb  # noqa: F401  (lazy: the GPU image has no wandb)
        except ImportError:
            raise UserError(
                "train.wandb.mode needs the wandb package; install it or set train.wandb.mode=disabled"
            ) from None
        trackers = "wandb"
    return Accelerator(
        cpu=cpu,
        mixed_precision="no" if cpu else "bf16",
        gradient_accumulation_steps=t.grad_accum,
        log_with=trackers,
        project_dir=str(RunDir.of(cfg).train),
    )


def plan_data(cfg, store: fs.FeatureStore, rank: int, world: int) -> Plan:
    t = cfg.train
    lengths = store.sample_lengths()
    train_idx, val_idx = split(len(lengths), t.val_fraction, cfg.seed, heldout_samples(cfg, rank))
    ctx = split_context(t)
    epochs = [
        plan_packs(train_idx, lengths, t.tokens_per_pack, cfg.seed, e, context=ctx) for e in range(t.epochs)
    ]
    steps = sum(len(rank_share(p, 0, rank, world, t.grad_accum)) // t.grad_accum for p in epochs)
    total_steps = min(steps, t.max_steps or steps)
    if total_steps < 1:
        raise UserError(
            f"no optimizer step fits: {len(train_idx)} training samples make {len(epochs[0])} packs, "
            f"fewer than {world} rank(s) x train.grad_accum={t.grad_accum}; lower tokens_per_pack or add data"
        )
    val_packs = shard_for_rank(
        plan_packs(val_idx, lengths, t.tokens_per_pack, cfg.seed, 0, shuffle=False, context=ctx), rank, world
    )
    splits = split_counts(
        train_idx, lengths, t.tokens_per_pack, ctx
    )  # nothing is cut: long samples are split
    if splits["samples"] and rank == 0:
        log.info(
            "train: %d of %d training samples are longer than train.tokens_per_pack=%d: split into %d "
            "windows, each later one repeating %d positions as unscored context (%d positions, %.1f%% "
            "of %d); every position is trained once",
            splits["samples"],
            len(train_idx),
            t.tokens_per_pack,
            splits["pieces"],
            ctx,
            splits["context_positions"],
            100 * splits["context_positions"] / max(splits["positions"], 1),
            splits["positions"],
        )
    return Plan(
        list(train_idx),
        list(val_idx),
        epochs,
        val_packs,
        total_steps,
        splits,
        int(sum(int(lengths[i]) for i in train_idx)),
    )


def heldout_samples(cfg, rank: int) -> list[int] | None:
    """The samples prepare set aside (data=mix's per-source held-out): validated on, never trained on."""
    ids = prepared.heldout_samples(cfg.run_dir)
    if ids is None and rank == 0:
        log.warning(
            "train: no %s/prepared/stats.json: cannot tell which samples prepare held out; holding out "
            "train.val_fraction=%s by sample",
            cfg.run_dir,
            cfg.train.val_fraction,
        )
    elif ids and rank == 0:
        log.info(
            "train: validating on the %d conversations prepare held out (data.sources[*].heldout); "
            "train.val_fraction is not used",
            len(ids),
        )
    return ids


def setup(cfg) -> tuple[Session, Plan]:
    from accelerate.utils import set_seed

    t = cfg.train
    store, d2t, t2d, vman = load_inputs(cfg)
    accelerator = make_accelerator(cfg)
    if features.online(cfg):
        store.device = accelerator.device  # this rank's replica of the target runs where its draft does
        log.info("train: train.features=online: the target runs on each pack (no feature store)")
    set_seed(cfg.seed)
    folder = Path(store.facts["target_path"])
    target_hf = targets.load_config(folder, cfg.target)
    if target_hf.hidden_size != store.hidden_size:
        raise UserError(f"target hidden size {target_hf.hidden_size} != feature store's {store.hidden_size}")
    plan = plan_data(cfg, store, accelerator.process_index, accelerator.num_processes)
    model = draft.build(
        folder,
        target_hf,
        store.aux_layer_ids,
        d2t,
        t2d,
        t.ttt_steps,
        t.attn_implementation,
        arch=t.draft_arch.value,
    )
    sharded = t.strategy == Strategy.fsdp
    model, optimizer, scheduler, trainable = _optimize(t, accelerator, model, sharded, plan.total_steps)
    fwd = dict(
        ttt_steps=t.ttt_steps,
        ttt_step_loss_decay=t.ttt_step_loss_decay,
        loss_config=losses.loss_config(t.loss, t.loss_chunk_tokens),
    )
    root = RunDir.of(cfg).train
    root.mkdir(parents=True, exist_ok=True)
    upstream = {
        "features_manifest_hash": store.manifest_hash(),
        "vocab_coverage": vman["coverage"],
        "target_fingerprint": store.facts["target_fingerprint"],
        "train_config_hash": digest(shaping(t, RESUMABLE_ACROSS)),
    }
    if accelerator.is_main_process:
        log.info(
            "train: %d train / %d val samples, %d packs/epoch/rank of <= %d tokens, %d ranks, %d steps, "
            "aux layers %s (from the feature store), draft vocab %d, %d trainable params",
            len(plan.train_idx),
            len(plan.val_idx),
            len(plan.epochs[0]) // accelerator.num_processes,
            t.tokens_per_pack,
            accelerator.num_processes,
            plan.total_steps,
            store.aux_layer_ids,
            len(d2t),
            sum(p.numel() for p in trainable),
        )
        if sharded:
            log.info("train: FSDP2, every parameter sharded over %d ranks", accelerator.num_processes)
    return Session(
        accelerator,
        model,
        optimizer,
        scheduler,
        trainable,
        fwd,
        store,
        root,
        upstream,
        sharded,
        list(plan.val_idx),
        d2t=d2t if d2t is not None else torch.zeros(target_hf.vocab_size, dtype=torch.long),
    ), plan


def rank_share(packs: list, done: int, rank: int, world: int, grad_accum: int) -> list:
    """This rank's packs of an epoch from global position `done` on: the rest dealt round-robin over the
    ranks, each share cut to whole optimizer steps (the tail that does not fill one step on every rank is
    dropped). A checkpoint records `done`, so it resumes on any number of ranks over exactly the packs not yet
    trained."""
    share = shard_for_rank(packs[done:], rank, world)
    return share[: len(share) - len(share) % grad_accum]


def _optimize(t, accelerator, model, sharded: bool, total_steps: int):
    """The draft sharded (train.strategy=fsdp) or prepared, its optimizer (train.optimizer) and LR scheduler:
    (model, optimizer, scheduler, trainable parameters)."""
    from transformers import get_scheduler

    if str(accelerator.distributed_type).endswith("FSDP"):
        raise UserError(
            "accelerate's own FSDP plugin is on (accelerate config / ACCELERATE_USE_FSDP): eaglepipe shards "
            "the draft itself; launch with conf/accelerate/fsdp.yaml and train.strategy=fsdp"
        )
    if sharded:
        if accelerator.num_processes < 2:
            raise UserError(
                "train.strategy=fsdp shards the draft over several ranks; this run has one: launch it "
                "with `accelerate launch --num_processes N` or `torchrun --nproc-per-node N` (N >= 2), "
                "or use train.strategy=ddp"
            )
        model = fsdp.shard(model, accelerator.device)  # before the optimizer: it holds the sharded parameters
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizers.build(t, model)
    scheduler = get_scheduler(
        t.schedule, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=total_steps
    )
    # The scheduler is NOT prepared: accelerate's wrapper steps it once per rank per optimizer step (it
    # assumes the per-rank batch was scaled up), so on 2 ranks the warmup and cosine ran at twice the speed.
    # Stepped once per optimizer step here, it counts optimizer steps on any number of ranks, and a
    # checkpoint resumes elastically.
    if sharded:  # accelerate cannot wrap or save an FSDP2 model on CPU: it keeps optimizer and accumulation
        optimizer = accelerator.prepare(optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
        accelerator.register_for_checkpointing(scheduler)
    return model, optimizer, scheduler, trainable
