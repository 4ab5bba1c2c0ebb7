"""Stage `train`: the EAGLE-3 draft (speculators' Eagle3DraftModel) trained by our loop under accelerate.

Accelerator -> set_seed -> data (packed, deterministic, sharded per rank) -> model -> optimizer/scheduler ->
prepare -> loop with accumulate / backward / clip / step and TTT unrolled inside the model's forward (eager
loss) -> checkpoints every N steps (resume=auto continues from the newest complete one, bit-identical on
CPU) -> train/final/ (speculators save_pretrained) + metrics.jsonl + plots/ (+ wandb).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pipeline.capture import features
from pipeline.config_choices import Select
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
    if t.warmup_steps < 0:
        problems.append(f"train.warmup_steps={t.warmup_steps} must be >= 0")
    if t.max_grad_norm is not None and t.max_grad_norm < 0:  # a negative norm flips the clipped gradient
        problems.append(f"train.max_grad_norm={t.max_grad_norm} must be > 0 (or 0 / null: no clipping)")
    if str(t.device).startswith("cuda") and not torch.cuda.is_available():
        problems.append(f"train.device={t.device} but this machine has no CUDA; use train.device=auto or cpu")
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
