"""Stage `train`: the EAGLE-3 draft (speculators' Eagle3DraftModel) trained by our loop under accelerate.

Accelerator -> set_seed -> data (packed, deterministic, sharded per rank) -> model -> optimizer/scheduler ->
prepare -> loop with accumulate / backward / clip / step and TTT unrolled inside the model's forward (eager
loss) -> checkpoints every N steps (resume=auto continues from the newest complete one, bit-identical on
CPU) -> train/final/ (speculators save_pretrained) + metrics.jsonl + plots/ (+ wandb).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from pipeline import config_limits
from pipeline.capture import features
from pipeline.config_choices import Select, Strategy
from pipeline.errors import UserError
from pipeline.fingerprint import digest, shaping
from pipeline.formats import train_summary
from pipeline.formats.run_dir import RunDir
from pipeline.models import draft
from pipeline.training.checkpoints import resume_or_clear
from pipeline.training.loop import log_metrics, loop, start_logging, tau_step, validate
from pipeline.training.report import end, finish
from pipeline.training.setup import NOT_SHAPING, setup

log = logging.getLogger(__name__)


def out_dir(cfg) -> Path:
    return RunDir.of(cfg).train


def check(cfg) -> None:
    t, problems = cfg.train, []  # ranges and closed sets: config_limits, checked before every stage's check
    if t.split_context is not None and t.split_context >= t.tokens_per_pack:
        problems.append(
            f"train.split_context={t.split_context} must be in [0, train.tokens_per_pack="
            f"{t.tokens_per_pack}) (or null: a quarter of it)"
        )
    if problem := config_limits.cuda_missing("train.device", t.device):
        problems.append(problem)
    if len(t.adam_betas) != 2:
        problems.append(f"train.adam_betas={list(t.adam_betas)} must be two values in [0, 1) (beta1, beta2)")
    if str(getattr(t.optimizer, "value", t.optimizer)) == "muon" and t.strategy == Strategy.fsdp:
        problems.append("train.optimizer=muon with train.strategy=fsdp is not supported yet; use ddp")
    if problem := _wandb_key_missing(t.wandb):
        problems.append(problem)
    if t.select == Select.tau and t.eval_tau_every_steps is None:
        problems.append(
            "train.select=tau picks the step of the highest tau: set train.eval_tau_every_steps too"
        )
    if problem := features.online_problem(cfg):
        problems.append(problem)
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


def _wandb_key_missing(w) -> str | None:
    """wandb online without an API key: wandb.init asks on the terminal (a batch job hangs) or fails late."""
    if str(getattr(w.mode, "value", w.mode)) != "online" or os.environ.get("WANDB_API_KEY"):
        return None
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="replace"):
        return None
    return (
        "train.wandb.mode=online but no wandb key here (WANDB_API_KEY or `wandb login`): log in, or set "
        "train.wandb.mode=offline (wandb sync later)"
    )


def fingerprint(cfg) -> str:
    vocab_manifest = RunDir.of(cfg).vocab_manifest
    return digest(
        {
            "vocab": vocab_manifest.read_text() if vocab_manifest.exists() else None,
            "seed": cfg.seed,
            "train": shaping(cfg.train, NOT_SHAPING),
        }
    )


def is_complete(cfg) -> bool:
    return train_summary.exists(out_dir(cfg) / "final")


def run(cfg) -> Path:
    check(cfg)
    s, plan = setup(cfg)
    if s.accelerator.device.type == "cuda":  # peak_memory: this stage's, not extract's in the same process
        torch.cuda.reset_peak_memory_stats(s.accelerator.device)
    progress = resume_or_clear(cfg, s)
    start_logging(cfg, s, plan, progress)
    loop(cfg, s, plan, progress)
    if (
        cfg.train.select == Select.tau and not s.best
    ):  # resumed at the last step with select=tau just turned on
        tau_step(s, cfg, progress.step)
    final_val = validate(s, cfg, plan.val_packs)
    log_metrics(s.accelerator, s.root / "metrics.jsonl", {"split": "val", **final_val}, progress.step)
    finish(s.accelerator, s.model, cfg, s.root, progress.step, final_val, s.upstream, plan)
    root = s.root
    end(s)
    return root
