"""Stage `evaluate`: how many tokens the exported draft gets accepted, on the prompts train held out.

Two benches, one entry shape (`measure(cfg, store, prompts, out)`):
- offline (default, no server): pipeline/acceptance/offline.py, greedy chain speculative decoding with the local
  target and the SGLang export read by a reference forward -> eval/acceptance.json (tau per draft length);
- online (`eval.endpoint=`): pipeline/acceptance/online.py, a running SGLang/vLLM server's own counters, and the
  speedup over `eval.baseline_endpoint` -> eval/online.json.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from pipeline.acceptance import offline as offline_bench
from pipeline.acceptance import online as online_bench
from pipeline.data.features_dataset import split
from pipeline.errors import UserError
from pipeline.fingerprint import digest, shaping
from pipeline.run_dir import RunDir

log = logging.getLogger(__name__)


def out_dir(cfg) -> Path:
    return RunDir.of(cfg).eval


# Knobs that cannot change evaluate's figures, left out of its fingerprint: a timeout only fails a run; the
# offline bench reads no server knob, the online one neither the draft lengths nor the local device.
NOT_SHAPING = ("endpoint_timeout_s",)
OFFLINE_ONLY = ("max_draft", "device")
ONLINE_ONLY = ("baseline_endpoint", "endpoint_concurrency")


def fingerprint(cfg) -> str:
    m = RunDir.of(cfg).export("sglang") / "export_manifest.json"
    unread = OFFLINE_ONLY if cfg.eval.endpoint else ONLINE_ONLY
    return digest({"export": m.read_text() if m.exists() else None, "eval": shaping(cfg.eval, NOT_SHAPING + unread)})


def is_complete(cfg) -> bool:
    return (out_dir(cfg) / ("online.json" if cfg.eval.endpoint else "acceptance.json")).is_file()


def check(cfg) -> None:
    """Every problem with the eval settings, before acceptance.json / online.json is replaced."""
    e, problems = cfg.eval, []
    for key in ("num_prompts", "max_new_tokens", "max_draft", "endpoint_concurrency"):
        if e[key] < 1:
            problems.append(f"eval.{key}={e[key]} must be >= 1")
    if e.prompt_tokens < 2:
        problems.append(f"eval.prompt_tokens={e.prompt_tokens} must be >= 2")
    if problems:
        raise UserError("; ".join(problems))


def run(cfg) -> Path:
    check(cfg)
    e, rd = cfg.eval, RunDir.of(cfg)
    if not e.endpoint and not (rd.export("sglang") / "export_manifest.json").is_file():  # what offline reads
        raise UserError(f"no SGLang export under {rd.export('sglang')}; run stage=export first")
    store = rd.open_features()
    prompts = heldout_prompts(cfg, store, e.num_prompts, e.prompt_tokens)
    # online: the server's own acceptance counters; offline: the greedy chain against the local target
    bench = online_bench if e.endpoint else offline_bench
    return bench.measure(cfg, store, prompts, out_dir(cfg))


def heldout_prompts(cfg, store, n: int, prompt_tokens: int) -> list[list[int]]:
    """Prefixes of the validation samples train held out (train_summary.json's `val_samples`) up to their first
    supervised token, i.e. up to where the assistant starts answering; at most prompt_tokens long."""
    summary = RunDir.of(cfg).final / "train_summary.json"
    val = json.loads(summary.read_text()).get("val_samples") if summary.is_file() else None
    if val is None:  # a draft trained before train recorded its split: the same seeded split, recomputed
        log.warning("evaluate: %s records no val_samples; recomputing the split from train.val_fraction", summary)
        val = split(len(store), cfg.train.val_fraction, cfg.seed)[1].tolist()
    if not val:
        raise UserError(f"{summary.parent} was trained with no held-out samples (train.val_fraction=0): evaluate "
                        "prompts only from samples the draft never saw; retrain with train.val_fraction > 0")
    prompts = []
    for i in val:
        s = store.sample(i)
        first = int(torch.nonzero(s["loss_mask"])[0]) if s["loss_mask"].any() else len(s["input_ids"])
        if 1 < first <= prompt_tokens:
            prompts.append(s["input_ids"][:first].tolist())
        if len(prompts) >= n:
            break
    if not prompts:
        raise UserError(f"none of the {len(val)} held-out samples has a prompt (the tokens before the first "
                        f"supervised one) of 2 to eval.prompt_tokens={prompt_tokens} tokens; raise eval.prompt_tokens")
    return prompts
