"""The training loop: epochs of micro-batches, logging, validation, tau probes and checkpoints on the
configured steps."""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections import defaultdict
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from pipeline.config_choices import Select
from pipeline.data.features_dataset import (
    STORE_ERROR,
    PackDataset,
)
from pipeline.errors import UserError
from pipeline.models import fsdp
from pipeline.training import positions
from pipeline.training.checkpoints import BEST_TAU, record, save
from pipeline.training.preemption import Preemption
from pipeline.training.session import Plan, Progress, Session
from pipeline.training.setup import pad_packs, rank_share

log = logging.getLogger(__name__)


def start_logging(cfg, s: Session, plan: Plan, p: Progress) -> None:
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
        log_metrics(s.accelerator, metrics_file, {"split": "val", **validate(s, cfg, plan.val_packs)}, 0)


def loop(cfg, s: Session, plan: Plan, p: Progress) -> None:
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
                metrics = micro_step(t, s, batch)
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
                        **summarise({k: float(v) for k, v in window.items()}, t.ttt_steps),
                        "lr": s.scheduler.get_last_lr()[0],
                        "epoch": p.epoch,
                        "tokens_per_s": window_tokens * acc.num_processes / (time.time() - t0),
                        "wall_s": round(time.time() - start, 2),
                    }
                    bar.set_description(f"train|ep {p.epoch}|step {p.step}|loss {rec['loss']:.3f}")
                    log_metrics(acc, metrics_file, rec, p.step)
                    window, t0, window_tokens = defaultdict(float), time.time(), 0
                if p.step % t.val_every_steps == 0 and p.step < plan.total_steps:
                    log_metrics(
                        acc, metrics_file, {"split": "val", **validate(s, cfg, plan.val_packs)}, p.step
                    )
                    s.model.train()
                if t.eval_tau_every_steps and (
                    p.step % t.eval_tau_every_steps == 0 or p.step == plan.total_steps
                ):
                    tau_step(s, cfg, p.step)
                    s.model.train()
                saved = p.step % t.save_every_steps == 0 or p.step == plan.total_steps
                if saved:
                    save(s, record(cfg, s, p), t.keep_last)
                if preemption.due(acc):  # SLURM's warning: checkpoint here, then submitit requeues the job
                    if not saved:
                        save(s, record(cfg, s, p), t.keep_last)
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


def tau_step(s: Session, cfg, step: int) -> None:
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
        log_metrics(
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


def micro_step(t, s: Session, batch: dict) -> dict:
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


def summarise(sums: dict, ttt_steps: int, prefix: str = "") -> dict:
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
def validate(s: Session, cfg, packs: list) -> dict:
    """Every rank its own packs (as many on each: under FSDP every forward is a collective)."""
    accelerator, model, fwd, store = s.accelerator, s.model, s.fwd, s.store
    model.eval()
    sums = defaultdict(float)
    from pipeline.data.features_dataset import collate

    for pack in packs:
        batch = {
            k: v.to(accelerator.device)
            for k, v in collate(
                store, pack, cfg.train.tokens_per_pack, pad_packs(cfg.train, accelerator.device), True
            ).items()
        }
        with accelerator.autocast():  # a prepared (DDP) model autocasts itself; an FSDP one does not
            m = positions.pack_metrics(
                model, _cast(batch, accelerator), fwd, s.d2t.to(accelerator.device), cfg.eval.max_new_tokens
            )
        for k, v in m.items():
            sums[k] += float(v)
    keys = sorted(sums)
    total = accelerator.reduce(
        torch.tensor([sums[k] for k in keys], device=accelerator.device), reduction="sum"
    )
    summed = dict(zip(keys, total.tolist()))
    out = summarise(summed, cfg.train.ttt_steps) | positions.ratios(summed)
    out["eval_max_new_tokens"] = cfg.eval.max_new_tokens  # what evalpos_* cut at
    return out


def log_metrics(accelerator, path: Path, rec: dict, step: int) -> None:
    if accelerator.is_main_process:
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, **rec}) + "\n")
        if rec["split"] == "val":
            log.info(
                "step %d val: %s",
                step,
                " ".join(
                    f"{k}={v:.4f}"
                    for k, v in rec.items()
                    if k.startswith(("loss", "full_acc", "token_acc", "evalpos_"))
                ),
            )
        if rec["split"] == "tau":
            log.info(
                "step %d tau: %s",
                step,
                " ".join(f"{k}={v:.3f}" for k, v in rec.items() if k.startswith("k=")),
            )
    prefix = rec["split"] + "/"
    accelerator.log({prefix + k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=step)


def _autocast(s: Session):
    """A prepared (DDP) model autocasts in its own forward; the FSDP2 one runs under accelerate's autocast
    here."""
    import contextlib

    return s.accelerator.autocast() if s.sharded else contextlib.nullcontext()
