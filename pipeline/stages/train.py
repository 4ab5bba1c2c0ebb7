"""Stage `train`: the EAGLE-3 draft (speculators' Eagle3DraftModel) trained by our loop under accelerate.

Accelerator -> set_seed -> data (packed, deterministic, sharded per rank) -> model -> optimizer/scheduler ->
prepare -> loop with accumulate / backward / clip / step and TTT unrolled inside the model's forward (eager
loss) -> checkpoints every N steps (resume=auto continues from the newest complete one, bit-identical on
CPU) -> train/final/ (speculators save_pretrained) + metrics.jsonl + plots/ (+ wandb).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from pipeline import __version__, features
from pipeline.config import Resume, Select, Strategy
from pipeline.data.features_dataset import (
    STORE_ERROR,
    PackDataset,
    plan_packs,
    shard_for_rank,
    split,
    split_counts,
)
from pipeline.errors import UserError
from pipeline.fingerprint import digest, shaping
from pipeline.formats import checkpoint, prepared, vocab_map
from pipeline.formats import feature_store as fs
from pipeline.models import draft, fsdp, losses, targets
from pipeline.run_dir import RunDir

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
BEST_TAU = "best_tau"  # train/best_tau/: the draft at the step of the highest tau so far (train.select=tau)


def out_dir(cfg) -> Path:
    return RunDir.of(cfg).train


def split_context(t) -> int:
    return t.tokens_per_pack // 4 if t.split_context is None else t.split_context


def check(cfg) -> None:
    t, problems = cfg.train, []
    for key in (
        "ttt_steps",
        "tokens_per_pack",
        "grad_accum",
        "epochs",
        "keep_last",
        "log_every_steps",
        "val_every_steps",
        "save_every_steps",
    ):
        if t[key] < 1:
            problems.append(f"train.{key}={t[key]} must be >= 1")
    if t.max_steps is not None and t.max_steps < 1:
        problems.append(f"train.max_steps={t.max_steps} must be >= 1 (or null: epochs x packs / grad_accum)")
    if t.split_context is not None and not 0 <= t.split_context < max(t.tokens_per_pack, 1):
        problems.append(
            f"train.split_context={t.split_context} must be in [0, train.tokens_per_pack="
            f"{t.tokens_per_pack}) (or null: a quarter of it)"
        )
    if not t.lr > 0:
        problems.append(f"train.lr={t.lr} must be > 0")
    if len(t.adam_betas) != 2 or not all(0 <= b < 1 for b in t.adam_betas):
        problems.append(f"train.adam_betas={list(t.adam_betas)} must be two values in [0, 1) (beta1, beta2)")
    if t.loss_chunk_tokens is not None and t.loss_chunk_tokens < 1:
        problems.append(
            f"train.loss_chunk_tokens={t.loss_chunk_tokens} must be >= 1 (or null: speculators' eager loss)"
        )
    if t.eval_tau_every_steps is not None and t.eval_tau_every_steps < 1:
        problems.append(f"train.eval_tau_every_steps={t.eval_tau_every_steps} must be >= 1 (or null: off)")
    if t.select == Select.tau and t.eval_tau_every_steps is None:
        problems.append(
            "train.select=tau picks the step of the highest tau: set train.eval_tau_every_steps too"
        )
    if problem := features.online_problem(cfg):
        problems.append(problem)
    if not 0 <= t.val_fraction < 1:
        problems.append(f"train.val_fraction={t.val_fraction} must be in [0, 1)")
    if t.attn_implementation not in draft.ATTENTION:
        problems.append(
            f"train.attn_implementation={t.attn_implementation!r} is not one of {list(draft.ATTENTION)}"
        )
    elif "flex" in t.attn_implementation and (
        t.device == "cpu" or t.device == "auto" and not torch.cuda.is_available()
    ):
        problems.append(
            f"train.attn_implementation={t.attn_implementation} needs a GPU (FlexAttention has no CPU "
            "backward); train with sdpa here"
        )
    if problems:
        raise UserError("; ".join(problems))


def fingerprint(cfg) -> str:
    vocab_manifest = RunDir.of(cfg).vocab / "manifest.json"
    return digest(
        {
            "vocab": vocab_manifest.read_text() if vocab_manifest.exists() else None,
            "seed": cfg.seed,
            "train": _shaping(cfg.train, NOT_SHAPING),
        }
    )


def pad_packs(t, device: torch.device) -> bool:
    """train.pad_packs, with null resolved: padded to one shape where the forward is compiled (CUDA)."""
    return bool(t.pad_packs) if t.pad_packs is not None else device.type == "cuda"


def _shaping(t, leave_out: tuple[str, ...]) -> dict:
    """The train section as fingerprinted: a knob added later leaves the fingerprint at its default (the Llama
    draft, DDP, offline features, no tau, select=last), so runs trained before it existed are not
    retrained."""
    data = shaping(t, leave_out)
    if (
        data.get("pad_packs") is None
    ):  # null: padded on CUDA only; the same loss either way (tests hold it), so it
        data["pad_packs"] = False  # hashes as the earlier default and no finished run is retrained for it
    for key, default in (
        ("draft_arch", "llama"),
        ("strategy", "ddp"),
        ("features", "offline"),
        ("eval_tau_every_steps", None),
        ("select", "last"),
        ("loss_chunk_tokens", 2048),
        ("adam_betas", [0.9, 0.95]),
    ):  # knobs added later, at the value they had before
        if key in data and data[key] == default:
            data.pop(key)
    return data


def is_complete(cfg) -> bool:
    return (out_dir(cfg) / "final" / "train_summary.json").is_file()


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
        project_dir=str(out_dir(cfg)),
    )


@dataclass
class Plan:
    """What the data gives this rank: the sample split, the packs of every epoch, the step count."""

    train_idx: list
    val_idx: list
    epochs: (
        list  # per epoch, ALL its packs in global order (each rank takes its share from the data position)
    )
    val_packs: list
    total_steps: int
    split: dict  # samples longer than a pack: how many, into how many windows, positions repeated as context
    train_tokens: int = 0  # tokens of the training samples (one epoch), held-out ones excluded


@dataclass
class Session:
    """What one training run works with, built once by `_setup`."""

    accelerator: object
    model: object
    optimizer: object
    scheduler: object
    trainable: list
    fwd: dict  # the draft's forward kwargs (TTT steps, loss)
    store: fs.FeatureStore
    root: Path
    upstream: dict  # what the weights depend on; a checkpoint of other upstream is refused
    sharded: bool = (
        False  # train.strategy=fsdp: the model is FSDP2-sharded (pipeline/models/fsdp.py), not prepared
    )
    val_idx: list = field(default_factory=list)  # held-out samples: tau's prompts come from them
    probe: object = None  # the tau probe (rank 0, made at the first tau step)
    best: dict = field(default_factory=dict)  # train.select=tau: {"step", "tau", "k"} of the best so far


@dataclass
class Progress:
    step: int = 0
    epoch: int = 0
    packs_done: int = 0  # packs of `epoch` already trained, all ranks together (a global position: elastic)


def run(cfg) -> Path:
    check(cfg)
    s, plan = _setup(cfg)
    if s.accelerator.device.type == "cuda":  # peak_memory: this stage's, not extract's in the same process
        torch.cuda.reset_peak_memory_stats(s.accelerator.device)
    progress = _resume_or_clear(cfg, s)
    _start_logging(cfg, s, plan, progress)
    _loop(cfg, s, plan, progress)
    if (
        cfg.train.select == Select.tau and not s.best
    ):  # resumed at the last step with select=tau just turned on
        _tau(s, cfg, progress.step)
    final_val = _validate(s, cfg, plan.val_packs)
    _log(s.accelerator, s.root / "metrics.jsonl", {"split": "val", **final_val}, progress.step)
    _finish(s.accelerator, s.model, cfg, s.root, progress.step, final_val, s.upstream, plan)
    root = s.root
    _end(s)
    return root


def _end(s: Session) -> None:
    """Tear the ranks down together. Every rank waits for rank 0's final save, then drops its DDP model (the
    Reducer holds the gloo process group: released after a peer has exited, its destructor joined a worker
    that
    waited on that peer for ever: 3 of 8 two-rank resumes on a loaded 2-core machine, test_ranks), then the
    process group goes."""
    import gc

    acc = s.accelerator
    acc.wait_for_everyone()
    s.model = s.optimizer = s.scheduler = s.trainable = s.probe = None
    acc.free_memory()
    gc.collect()
    acc.wait_for_everyone()
    acc.end_training()


def _plan(cfg, store: fs.FeatureStore, rank: int, world: int) -> Plan:
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


def _setup(cfg) -> tuple[Session, Plan]:
    from accelerate.utils import set_seed
    from transformers import get_scheduler

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
    plan = _plan(cfg, store, accelerator.process_index, accelerator.num_processes)
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
    optimizer = torch.optim.AdamW(trainable, lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.adam_betas))
    scheduler = get_scheduler(
        t.schedule, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=plan.total_steps
    )
    # The scheduler is NOT prepared: accelerate's wrapper steps it once per rank per optimizer step (it
    # assumes the
    # per-rank batch was scaled up), so on 2 ranks the warmup and cosine ran at twice the speed. Stepped once
    # per
    # optimizer step here, it counts optimizer steps on any number of ranks, and a checkpoint resumes
    # elastically.
    if (
        sharded
    ):  # accelerate cannot wrap or save an FSDP2 model on CPU: it keeps the optimizer and accumulation
        optimizer = accelerator.prepare(optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
        accelerator.register_for_checkpointing(scheduler)
    fwd = dict(
        ttt_steps=t.ttt_steps,
        ttt_step_loss_decay=t.ttt_step_loss_decay,
        loss_config=losses.loss_config(t.loss, t.loss_chunk_tokens),
    )
    root = out_dir(cfg)
    root.mkdir(parents=True, exist_ok=True)
    upstream = {
        "features_manifest_hash": store.manifest_hash(),
        "vocab_coverage": vman["coverage"],
        "target_fingerprint": store.facts["target_fingerprint"],
        "train_config_hash": digest(_shaping(t, RESUMABLE_ACROSS)),
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
    ), plan


def _resume_or_clear(cfg, s: Session) -> Progress:
    """resume=auto: continue from the newest complete checkpoint of the same upstream; else start fresh, with
    every earlier checkpoint set aside (never resumed later; deleted once this run has a checkpoint)."""
    found = checkpoint.latest(s.root) if cfg.train.resume == Resume.auto else None
    if found:
        state = found[1]
        refuse = (
            f"checkpoint {found[0]} was trained on other inputs or another train config; "
            "use a new run_dir or train.resume=never (it replaces the checkpoints under train/)"
        )
        if (
            state["upstream"] != s.upstream or state["seed"] != cfg.seed
        ):  # read before load_state touches the model
            raise UserError(refuse)
        try:
            _load(s, found[0])
        except RuntimeError as e:  # same recorded upstream, other shapes (e.g. a vocab of another size)
            if "size mismatch" not in str(e):
                raise
            raise UserError(f"{refuse} (its tensors have other shapes than this draft's)") from None
        # checkpoints before the global position (all single-process) counted this rank's micro-batches
        p = Progress(
            state["optimizer_step"],
            state["epoch"],
            state.get("packs_done_in_epoch", state.get("batches_done_in_epoch")),
        )
        s.best = dict(state.get("best_tau") or {})
        world, was = s.accelerator.num_processes, state.get("world_size", 1)
        log.info(
            "train: resumed from %s (step %d, epoch %d, %d packs into it), on %d rank(s)%s",
            found[0],
            p.step,
            p.epoch,
            p.packs_done,
            world,
            f" (it was written by {was})" if was != world else "",
        )
        batch, was_batch = world * cfg.train.grad_accum, was * state.get("grad_accum", cfg.train.grad_accum)
        if batch != was_batch:
            log.warning(
                "train: %d packs per optimizer step now (ranks x grad_accum), %d before the checkpoint: the "
                "remaining packs are trained at the new batch (keep ranks x grad_accum for an exact resume)",
                batch,
                was_batch,
            )
        return p
    if s.accelerator.is_main_process:
        stale = checkpoint.set_aside(s.root)
        if stale:
            log.warning(
                "train: starting fresh; %d earlier checkpoint/final folders moved to %s, deleted when this "
                "run writes its first checkpoint (move them back before then to keep them)",
                stale,
                s.root / checkpoint.REPLACED,
            )
    return Progress()


def _start_logging(cfg, s: Session, plan: Plan, p: Progress) -> None:
    t = cfg.train
    if t.wandb.mode != "disabled":
        s.accelerator.init_trackers(
            t.wandb.project,
            config=OmegaConf.to_container(cfg, resolve=True),
            init_kwargs={
                "wandb": {
                    "mode": t.wandb.mode.value,
                    "name": t.wandb.name or cfg.run_name,
                    "dir": str(s.root),
                }
            },
        )
    if p.step == 0:
        metrics_file = s.root / "metrics.jsonl"
        metrics_file.unlink(missing_ok=True)
        _log(s.accelerator, metrics_file, {"split": "val", **_validate(s, cfg, plan.val_packs)}, 0)


def _loop(cfg, s: Session, plan: Plan, p: Progress) -> None:
    """Epochs of micro-batches from p onwards; logs, validates and checkpoints on the configured steps."""
    preemption = Preemption()
    try:
        _epochs(cfg, s, plan, p, preemption)
    finally:  # submitit's handler back, for what follows the loop (validation, final/, other stages)
        preemption.close()


def _epochs(cfg, s: Session, plan: Plan, p: Progress, preemption) -> None:
    t, acc = cfg.train, s.accelerator
    metrics_file = s.root / "metrics.jsonl"
    window, t0, window_tokens = defaultdict(float), time.time(), 0
    start = t0  # wall_s: seconds since this process's loop began (validation and checkpoints included)
    # the bar is closed (its line ended) on an error too, so the one-line error starts a line of its own
    with tqdm(
        total=plan.total_steps, initial=p.step, disable=not acc.is_local_main_process, desc="train"
    ) as bar:
        while p.step < plan.total_steps and p.epoch < t.epochs:
            mine = rank_share(
                plan.epochs[p.epoch], p.packs_done, acc.process_index, acc.num_processes, t.grad_accum
            )
            online = (
                s.store.root is None
            )  # the target runs in this process, on this rank's device: no workers
            loader = torch.utils.data.DataLoader(
                PackDataset(
                    s.store if online else s.store.root, mine, t.tokens_per_pack, pad_packs(t, acc.device)
                ),
                batch_size=None,
                shuffle=False,
                num_workers=0 if online else t.num_workers,
                pin_memory=acc.device.type == "cuda" and not online,
            )
            s.model.train()
            for batch in loader:
                if STORE_ERROR in batch:
                    raise UserError(batch[STORE_ERROR])
                metrics = _micro_step(t, s, batch)
                p.packs_done += acc.num_processes
                window_tokens += int((batch["document_ids"] != -1).sum())  # real tokens, padding not counted
                for (
                    k,
                    v,
                ) in metrics.items():  # summed on the device; read back only when logging (no per-step sync)
                    window[k] = window[k] + v.detach()
                if not acc.sync_gradients:
                    continue
                p.step += 1
                bar.update(1)
                if p.step % t.log_every_steps == 0 or p.step == plan.total_steps:
                    rec = {
                        "split": "train",
                        **_summarise({k: float(v) for k, v in window.items()}, t.ttt_steps),
                        "lr": s.scheduler.get_last_lr()[0],
                        "epoch": p.epoch,
                        "tokens_per_s": window_tokens * acc.num_processes / (time.time() - t0),
                        "wall_s": round(time.time() - start, 2),
                    }
                    bar.set_description(f"train|ep {p.epoch}|step {p.step}|loss {rec['loss']:.3f}")
                    _log(acc, metrics_file, rec, p.step)
                    window, t0, window_tokens = defaultdict(float), time.time(), 0
                if p.step % t.val_every_steps == 0 and p.step < plan.total_steps:
                    _log(acc, metrics_file, {"split": "val", **_validate(s, cfg, plan.val_packs)}, p.step)
                    s.model.train()
                if t.eval_tau_every_steps and (
                    p.step % t.eval_tau_every_steps == 0 or p.step == plan.total_steps
                ):
                    _tau(s, cfg, p.step)
                    s.model.train()
                saved = p.step % t.save_every_steps == 0 or p.step == plan.total_steps
                if saved:
                    _save(s, _state(cfg, s, p), t.keep_last)
                if preemption.due(acc):  # SLURM's warning: checkpoint here, then submitit requeues the job
                    if not saved:
                        _save(s, _state(cfg, s, p), t.keep_last)
                    log.warning(
                        "train: preemption signal: checkpoint at step %d written; the job is requeued and "
                        "resumes from it (train.resume=auto)",
                        p.step,
                    )
                    preemption.hand_over()
                if p.step >= plan.total_steps:
                    break
            if p.step < plan.total_steps:  # this epoch's share is done (the loader ran out)
                p.epoch, p.packs_done = p.epoch + 1, 0


def _state(cfg, s: Session, p: Progress) -> dict:
    """What a checkpoint records beside accelerate's state: the global data position and what it was trained
    on."""
    return {
        "optimizer_step": p.step,
        "epoch": p.epoch,
        "packs_done_in_epoch": p.packs_done,
        "world_size": s.accelerator.num_processes,
        "grad_accum": cfg.train.grad_accum,
        "seed": cfg.seed,
        "upstream": s.upstream,
        "best_tau": s.best or None,
    }


class Preemption:
    """A job under submitit (hydra/launcher=slurm|local): SLURM's warning signal before a time limit or a
    preemption (SIGUSR2, or SUBMITIT_PREEMPT_SIGNAL) only sets a flag here; the loop writes a checkpoint at
    the
    next optimizer step and then hands the signal to submitit's own handler, which requeues the job (same
    overrides, same run dir) and exits; the requeued job resumes from that checkpoint. Outside submitit
    nothing is installed. On several ranks the flag is agreed on (a max over ranks) once per optimizer
    step."""

    def __init__(self):
        self.requested, self.previous = False, None
        if "SUBMITIT_EXECUTOR" not in os.environ:
            return
        self.signum = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper())
        self.previous = signal.getsignal(self.signum)
        signal.signal(self.signum, self._flag)

    def _flag(self, signum, frame) -> None:
        self.requested = True

    def due(self, accelerator) -> bool:
        if self.previous is None:
            return False
        if accelerator.num_processes == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=accelerator.device)
        return float(accelerator.reduce(flag, reduction="sum")) > 0

    def close(self) -> None:
        """The loop is over: submitit's handler back; a signal that came after the last checkpoint is handed
        on
        now (the requeued job resumes at the end and only finishes)."""
        if self.previous is None:
            return
        signal.signal(self.signum, self.previous)
        if self.requested and callable(self.previous):
            self.previous(self.signum, None)

    def hand_over(self) -> None:
        previous, self.previous = self.previous, None  # handed on once: close() has nothing left to do
        signal.signal(self.signum, previous)
        if callable(previous):
            previous(self.signum, None)  # submitit: checkpoint() -> requeue -> exit
        else:  # SIG_DFL / SIG_IGN: nothing of submitit's to hand to; stop so a restart resumes
            raise SystemExit(f"train: preemption signal {self.signum}: checkpoint written, stopping")


def _tau(s: Session, cfg, step: int) -> None:
    """tau of the draft as exported (acceptance/in_training.py), logged as split "tau" (rank 0); with
    train.select=tau a new best is saved to train/best_tau/ (the export takes it)."""
    acc = s.accelerator
    weights = fsdp.full_state_dict(s.model) if s.sharded else None  # a collective: every rank gathers
    if acc.is_main_process:
        from pipeline.acceptance.in_training import TauProbe

        draft = acc.unwrap_model(s.model)
        weights = weights if s.sharded else draft.state_dict()
        if s.probe is None:
            s.probe = TauProbe(cfg, s.store, s.val_idx)
        t0 = time.time()
        taus = s.probe(weights, json.loads(draft.config.to_json_string()))
        k = select_k(cfg)
        _log(
            acc,
            s.root / "metrics.jsonl",
            {"split": "tau", **{f"k={j}": v for j, v in taus.items()}, "seconds": round(time.time() - t0, 2)},
            step,
        )
        if cfg.train.select == Select.tau and taus[k] > s.best.get("tau", float("-inf")):
            s.best = {"step": step, "tau": taus[k], "k": k}
            best = s.root / BEST_TAU
            shutil.rmtree(best, ignore_errors=True)
            draft.save_pretrained(str(best), **({"state_dict": weights} if s.sharded else {}))
            (best / "selected.json").write_text(json.dumps(s.best))
            log.info(
                "train: step %d has the best tau so far at k=%d (%.4f): saved to %s", step, k, taus[k], best
            )
    acc.wait_for_everyone()


def select_k(cfg) -> int:
    """The draft length train.select=tau compares at: the server's chain (export.serve.num_steps), within
    the k evaluated."""
    return max(1, min(cfg.export.serve.num_steps, cfg.eval.max_draft))


def rank_share(packs: list, done: int, rank: int, world: int, grad_accum: int) -> list:
    """This rank's packs of an epoch from global position `done` on: the rest dealt round-robin over the
    ranks,
    each share cut to whole optimizer steps (the tail that does not fill one step on every rank is dropped).
    A checkpoint records `done`, so it resumes on any number of ranks over exactly the packs not yet
    trained."""
    share = shard_for_rank(packs[done:], rank, world)
    return share[: len(share) - len(share) % grad_accum]


def _micro_step(t, s: Session, batch: dict) -> dict:
    """One micro-batch forward/backward; the optimizer steps when accelerate's accumulation window closes.
    Returns the draft's metric sums (tensors on the device)."""
    acc = s.accelerator
    batch = {k: v.to(acc.device, non_blocking=True) for k, v in batch.items()}
    with acc.accumulate(s.model), _autocast(s):
        _, loss, metrics = s.model(**_cast(batch, acc), **s.fwd)
        acc.backward(loss)
        if acc.sync_gradients and t.max_grad_norm:
            acc.clip_grad_norm_(s.trainable, t.max_grad_norm)
        s.optimizer.step()  # accelerate's optimizer steps only when the accumulation window closes
        if acc.sync_gradients:
            s.scheduler.step()
        s.optimizer.zero_grad(set_to_none=True)
    return metrics


def _cast(batch: dict, accelerator) -> dict:
    dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
    out = dict(batch)
    for k in ("hidden_states", "verifier_last_hidden_states"):
        out[k] = batch[k].to(dtype)
    return out


def _summarise(sums: dict, ttt_steps: int, prefix: str = "") -> dict:
    out = {f"{prefix}loss": sums.get("loss_sum", 0.0) / max(sums.get("loss_total", 0.0), 1e-9)}
    for k in range(ttt_steps):
        out[f"{prefix}loss_{k}"] = sums.get(f"loss_{k}_sum", 0.0) / max(
            sums.get(f"loss_{k}_total", 0.0), 1e-9
        )
        for name in ("full_acc", "cond_acc"):
            total = sums.get(f"{name}_{k}_total", 0.0)
            out[f"{prefix}{name}_{k}"] = sums.get(f"{name}_{k}_sum", 0.0) / total if total else float("nan")
    return out


@torch.no_grad()
def _validate(s: Session, cfg, packs: list) -> dict:
    """Every rank its own packs (as many on each: under FSDP every forward is a collective)."""
    accelerator, model, fwd, store = s.accelerator, s.model, s.fwd, s.store
    model.eval()
    sums = defaultdict(float)
    from pipeline.data.features_dataset import collate

    for pack in packs:
        batch = {
            k: v.to(accelerator.device)
            for k, v in collate(
                store, pack, cfg.train.tokens_per_pack, pad_packs(cfg.train, accelerator.device)
            ).items()
        }
        with accelerator.autocast():  # a prepared (DDP) model autocasts itself; an FSDP one does not
            _, _, m = model(**_cast(batch, accelerator), **fwd)
        for k, v in m.items():
            sums[k] += float(v)
    keys = sorted(sums)
    total = accelerator.reduce(
        torch.tensor([sums[k] for k in keys], device=accelerator.device), reduction="sum"
    )
    return _summarise(dict(zip(keys, total.tolist())), cfg.train.ttt_steps)


def _log(accelerator, path: Path, rec: dict, step: int) -> None:
    if accelerator.is_main_process:
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, **rec}) + "\n")
        if rec["split"] == "val":
            log.info(
                "step %d val: %s",
                step,
                " ".join(f"{k}={v:.4f}" for k, v in rec.items() if k.startswith(("loss", "full_acc"))),
            )
        if rec["split"] == "tau":
            log.info(
                "step %d tau: %s",
                step,
                " ".join(f"{k}={v:.3f}" for k, v in rec.items() if k.startswith("k=")),
            )
    prefix = rec["split"] + "/"
    accelerator.log({prefix + k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=step)


def _save(s: Session, state: dict, keep_last: int) -> None:
    accelerator, root = s.accelerator, s.root
    accelerator.wait_for_everyone()
    tmp = checkpoint.begin(root, state["optimizer_step"]) if accelerator.is_main_process else None
    accelerator.wait_for_everyone()
    folder = checkpoint.step_dir(root, state["optimizer_step"]).with_suffix(".tmp")
    if s.sharded:  # every rank its shards; the scheduler once
        fsdp.save(folder, s.model, s.optimizer)
        if accelerator.is_main_process:
            torch.save(s.scheduler.state_dict(), folder / SCHEDULER)
    else:
        accelerator.save_state(str(folder))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        checkpoint.finish(root, tmp, state, keep_last)
    accelerator.wait_for_everyone()


SCHEDULER = "scheduler.pt"  # train.strategy=fsdp: the LR scheduler beside the DCP shards


def _load(s: Session, folder: Path) -> None:
    if not s.sharded:
        s.accelerator.load_state(str(folder))
        return
    if not fsdp.is_checkpoint(folder):
        raise UserError(
            f"checkpoint {folder} is not an FSDP checkpoint (no {fsdp.DCP_DIR}/); resume it with the "
            "strategy that wrote it, or train.resume=never"
        )
    fsdp.load(folder, s.model, s.optimizer)
    s.scheduler.load_state_dict(torch.load(folder / SCHEDULER, weights_only=True))


def _autocast(s: Session):
    """A prepared (DDP) model autocasts in its own forward; the FSDP2 one runs under accelerate's autocast
    here."""
    import contextlib

    return s.accelerator.autocast() if s.sharded else contextlib.nullcontext()


def _finish(
    accelerator, model, cfg, root: Path, step: int, final_val: dict, upstream: dict, plan: Plan
) -> None:
    accelerator.wait_for_everyone()
    sharded = cfg.train.strategy == Strategy.fsdp
    full = (
        fsdp.full_state_dict(model) if sharded else None
    )  # a collective: every rank gathers, rank 0 keeps it
    if not accelerator.is_main_process:
        return
    final = root / "final"
    accelerator.unwrap_model(model).save_pretrained(str(final), **({"state_dict": full} if sharded else {}))
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    first_val = next(r for r in rows if r["split"] == "val")
    summary = {
        "produced_by": f"eaglepipe {__version__}",
        "optimizer_steps": step,
        "upstream": upstream,
        "val_before": first_val,
        "val_after": final_val,
        "val_samples": [int(i) for i in plan.val_idx],  # held out by sample; evaluate prompts from these
        "train_samples": len(plan.train_idx),
        "train_tokens": plan.train_tokens,
        "tau_probe_half": "selection",  # prompt_sets.selection_and_report: evaluate reports on the other
        "split_by_tokens_per_pack": plan.split,
        "throughput": _throughput(rows),
        "peak_memory": _peak_memory(accelerator.device),
        "world_size": accelerator.num_processes,
        "grad_accum": cfg.train.grad_accum,
        "strategy": str(getattr(cfg.train.strategy, "value", cfg.train.strategy)),
        "selected": _selected(cfg, root, step),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    (final / "train_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    _plot(rows, root / "plots", cfg.train.ttt_steps)
    log.info(
        "train: val full_acc_0 %.4f -> %.4f after %d steps; draft saved to %s",
        first_val["full_acc_0"],
        final_val["full_acc_0"],
        step,
        final,
    )


def _selected(cfg, root: Path, step: int) -> dict:
    """Which weights the export takes: final/ (the last step), or train/best_tau/ (train.select=tau)."""
    if cfg.train.select != Select.tau:
        return {"by": "last", "step": step}
    best = json.loads((root / BEST_TAU / "selected.json").read_text())
    log.info(
        "train: train.select=tau: the export takes step %d (tau %.4f at k=%d) from %s",
        best["step"],
        best["tau"],
        best["k"],
        root / BEST_TAU,
    )
    return {"by": "tau", **best, "path": BEST_TAU}


def _peak_memory(device) -> dict:
    """Rank 0's peak CUDA allocation over the stage since run() reset it (draft, optimizer, activations; with
    train.features=online the target replica too); {} off CUDA."""
    if device.type != "cuda":
        return {}
    return {
        "device": torch.cuda.get_device_name(device),
        "max_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "max_reserved_bytes": torch.cuda.max_memory_reserved(device),
    }


def _throughput(rows: list[dict]) -> dict:
    """Real (unpadded) tokens per second over the logged windows, all ranks together: the median and the last
    (the first window also holds compilation)."""
    rates = [r["tokens_per_s"] for r in rows if r.get("split") == "train" and "tokens_per_s" in r]
    if not rates:
        return {"windows": 0}
    return {
        "windows": len(rates),
        "tokens_per_s_median": sorted(rates)[len(rates) // 2],
        "tokens_per_s_last": rates[-1],
    }


def _plot(rows: list[dict], out: Path, ttt_steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    taus = [r for r in rows if r["split"] == "tau"]
    fig, axes = plt.subplots(1, 3 if taus else 2, figsize=(16 if taus else 11, 4))
    if taus:  # beside loss and accuracy: what serving gets (issue #17)
        for key in sorted({k for r in taus for k in r if k.startswith("k=")}, key=lambda k: int(k[2:])):
            axes[2].plot([r["step"] for r in taus], [r[key] for r in taus], "o-", label=f"tau {key}")
    for part, style in (("train", "-"), ("val", "o--")):
        pts = [r for r in rows if r["split"] == part]
        for k in range(ttt_steps):
            xs = [r["step"] for r in pts]
            axes[0].plot(xs, [r[f"loss_{k}"] for r in pts], style, label=f"{part} loss_{k}")
            axes[1].plot(xs, [r[f"full_acc_{k}"] for r in pts], style, label=f"{part} full_acc_{k}")
    for ax, title in zip(
        axes, ("loss per TTT step", "full accuracy per TTT step", "tau of the draft as exported")
    ):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=100)
    plt.close(fig)
