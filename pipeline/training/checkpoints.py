"""Checkpoints of a training run: what each records, save/load (DDP or FSDP2), resume or start fresh,
and which weights the export takes (train.select)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from pipeline.config_choices import Resume, Select
from pipeline.errors import UserError
from pipeline.formats import checkpoint
from pipeline.models import fsdp
from pipeline.training.session import Progress, Session

log = logging.getLogger(__name__)


BEST_TAU = "best_tau"  # train/best_tau/: the draft at the step of the highest tau so far (train.select=tau)


def resume_or_clear(cfg, s: Session) -> Progress:
    """resume=auto: continue from the newest complete checkpoint of the same upstream; else start fresh, with
    every earlier checkpoint set aside (never resumed later; deleted once this run has a checkpoint)."""
    found = _newest_intact(s) if cfg.train.resume == Resume.auto else None
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
        if "checksums" not in state:  # written before checkpoints recorded their sha256
            raise UserError(
                f"checkpoint {found[0]} was written by an older eaglepipe (no checksums); use a new run_dir "
                "or train.resume=never (it replaces the checkpoints under train/)"
            )
        if "packs_done_in_epoch" not in state:  # written before the global data position existed
            raise UserError(
                f"checkpoint {found[0]} was written by an older eaglepipe (no global data position); use a "
                "new run_dir or train.resume=never (it replaces the checkpoints under train/)"
            )
        try:
            load(s, found[0])
        except RuntimeError as e:  # same recorded upstream, other shapes (e.g. a vocab of another size)
            if "size mismatch" not in str(e):
                raise
            raise UserError(f"{refuse} (its tensors have other shapes than this draft's)") from None
        p = Progress(state["optimizer_step"], state["epoch"], state["packs_done_in_epoch"])
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


def _newest_intact(s: Session) -> tuple[Path, dict] | None:
    """The newest checkpoint whose files match the sha256 recorded when it was written (every rank checks
    the same files and picks the same one); damaged newer ones are skipped with one warning naming them, and
    if every one is damaged, one line naming them and the fix."""
    damaged = []
    for folder, state in checkpoint.candidates(s.root):
        problem = None if state is not None and "checksums" not in state else checkpoint.damage(folder, state)
        if problem is None:  # intact (or written before checksums: resume_or_clear refuses it)
            if damaged and s.accelerator.is_main_process:
                log.warning(
                    "train: skipping damaged checkpoint(s) %s; resuming from the previous complete one, %s",
                    "; ".join(damaged),
                    folder,
                )
            return folder, state
        damaged.append(f"{folder} ({problem})")
    if damaged:
        raise UserError(
            f"no intact checkpoint to resume: {'; '.join(damaged)}; train.resume=never trains from scratch "
            f"(it sets them aside under {s.root / checkpoint.REPLACED})"
        )
    return None


def record(cfg, s: Session, p: Progress) -> dict:
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


def save(s: Session, state: dict, keep_last: int) -> None:
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


def load(s: Session, folder: Path) -> None:
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


def selected(cfg, root: Path, step: int) -> dict:
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
