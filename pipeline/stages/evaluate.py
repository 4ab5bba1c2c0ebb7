"""Stage `evaluate`: how many tokens the exported draft gets accepted, per prompt set (`eval.sets`): the
prompts train held out (`heldout`, written to eval/), and standard sets from PyPI wheels (mt_bench, humaneval:
pipeline/data/prompt_sets.py; each written to eval/<set>/, with one table over the sets in eval/sets.json;
online in eval/sets_online.json).

Two benches, one entry shape (`measure(cfg, store, prompts, out)`):
- offline (default, no server): pipeline/acceptance/offline.py, greedy chain speculative decoding with the
local
  target and the SGLang export read by a reference forward -> eval/acceptance.json (tau per draft length);
- online (`eval.endpoint=`): pipeline/serving/bench.py, a running SGLang/vLLM server's own counters, and
the
  speedup over `eval.baseline_endpoint` -> eval/online.json.
"""

from __future__ import annotations

import json
import logging
from contextlib import nullcontext
from pathlib import Path

from pipeline import config_limits
from pipeline.acceptance import offline as offline_bench
from pipeline.acceptance.prompts import heldout_prompts, set_prompts
from pipeline.capture import features
from pipeline.data import prompt_sets
from pipeline.errors import UserError
from pipeline.fingerprint import digest, shaping
from pipeline.formats import eval_reports
from pipeline.formats import export_layouts as lay
from pipeline.formats.run_dir import RunDir
from pipeline.serving import bench as online_bench

log = logging.getLogger(__name__)


def out_dir(cfg) -> Path:
    return RunDir.of(cfg).eval


# Knobs that cannot change evaluate's figures, left out of its fingerprint: a timeout only fails a run; the
# offline bench reads no server knob, the online one neither the draft lengths nor the local device.
NOT_SHAPING = ("endpoint_timeout_s", "batch_size")  # batch_size: the same tau either way (tests hold it)
OFFLINE_ONLY = ("max_draft", "device")
ONLINE_ONLY = ("baseline_endpoint", "concurrency", "repeats", "warmup_prompts")


def fingerprint(cfg) -> str:
    m = RunDir.of(cfg).export_manifest("sglang")
    unread = OFFLINE_ONLY if cfg.eval.endpoint else ONLINE_ONLY
    if not any(name in prompt_sets.SECOND_TURN for name in cfg.eval.sets):  # read by second-turn sets only
        unread += ("first_answer_tokens",)
    return digest(
        {"export": m.read_text() if m.exists() else None, "eval": shaping(cfg.eval, NOT_SHAPING + unread)}
    )


def set_dir(cfg, name: str) -> Path:
    return out_dir(cfg) if name == prompt_sets.HELDOUT else out_dir(cfg) / name


def is_complete(cfg) -> bool:
    result = eval_reports.name(bool(cfg.eval.endpoint))
    return all((set_dir(cfg, name) / result).is_file() for name in cfg.eval.sets)


def check(cfg) -> None:
    """Every problem with the eval settings, before acceptance.json / online.json is replaced."""
    e, problems = cfg.eval, []  # ranges: config_limits, checked before every stage's check
    if not e.concurrency or len(set(e.concurrency)) != len(e.concurrency):
        problems.append(
            f"eval.concurrency={list(e.concurrency)}: a list of distinct numbers >= 1, e.g. [1,8,32]"
        )
    if not e.endpoint and (problem := config_limits.cuda_missing("eval.device", e.device)):
        problems.append(problem)
    unknown = [n for n in e.sets if n not in prompt_sets.names()]
    if unknown or not e.sets or len(set(e.sets)) != len(e.sets):
        problems.append(
            f"eval.sets={list(e.sets)}: a list of distinct names from {', '.join(prompt_sets.names())}"
        )
    if problems:
        raise UserError("; ".join(problems))


def run(cfg) -> Path:
    check(cfg)
    e, rd = cfg.eval, RunDir.of(cfg)
    if not e.endpoint and not rd.export_manifest("sglang").is_file():  # what offline reads
        raise UserError(f"no SGLang export under {rd.export('sglang')}; run stage=export first")
    if not e.endpoint and (problem := lay.damage(rd.export("sglang"))):
        raise UserError(f"the SGLang export is damaged: {problem}; rerun stage=export (it exports it again)")
    store = features.open_source(cfg)
    # online: the server's own acceptance counters; offline: the greedy chain against the local target
    bench = online_bench if e.endpoint else offline_bench
    with (
        nullcontext() if e.endpoint else offline_bench.one_target()
    ):  # one load of the fp32 target for every set
        for name in e.sets:
            prompts = (
                heldout_prompts(cfg, store, e.num_prompts, e.prompt_tokens)
                if name == prompt_sets.HELDOUT
                else set_prompts(cfg, store, name, e.num_prompts, e.prompt_tokens, bench)
            )
            log.info("evaluate: set %s, %d prompts", name, len(prompts))
            bench.measure(cfg, store, prompts, set_dir(cfg, name))
    _sets_table(cfg)
    return out_dir(cfg)


def _sets_table(cfg) -> None:
    """A log table and its JSON, one row per prompt set. Offline (eval/sets.json): tau of the trained draft
    per
    draft length. Online (eval.endpoint, eval/sets_online.json, so the offline table stays): the server's
    accept length and, with a baseline server, the speedup (SpecBundle's shape: one accept length per
    benchmark at the
    server's own steps / topk / draft tokens)."""
    rows = {}
    if cfg.eval.endpoint:
        for name in cfg.eval.sets:
            report = eval_reports.read(set_dir(cfg, name), online=True)
            spec = report["speculative"]
            rows[name] = {
                "prompts": spec["requests"],
                "accept_length": spec["accept_length"],
                "accept_length_ci95": spec.get("accept_length_ci95"),  # over prompts; null on vLLM
                "tokens_per_s": spec["tokens_per_s"],
                "speedup": report.get("speedup"),
                "speedup_by_concurrency": {
                    c: row.get("speedup_median") for c, row in (report.get("by_concurrency") or {}).items()
                },
            }
        lines = [f"{'set':<16}{'prompts':>8}{'accept length':>15}{'tokens/s':>11}{'speedup':>9}"]
        lines += [
            f"{name:<16}{r['prompts']:>8}"
            + (f"{r['accept_length']:>15.3f}" if r["accept_length"] else f"{'n/a':>15}")
            + f"{r['tokens_per_s']:>11.1f}"
            + (f"{r['speedup']:>9.2f}" if r["speedup"] else f"{'':>9}")
            for name, r in rows.items()
        ]
        lines += [
            f"{name}: accept length 95 % interval over its {r['prompts']} prompts "
            f"{r['accept_length_ci95'][0]:.3f}-{r['accept_length_ci95'][1]:.3f}"
            for name, r in rows.items()
            if r["accept_length_ci95"]
        ]
        log.info(
            "evaluate, the server's accept length per prompt set (%s):\n%s",
            cfg.eval.endpoint,
            "\n".join(lines),
        )
    else:
        for name in cfg.eval.sets:
            report = eval_reports.read(set_dir(cfg, name), online=False)
            rows[name] = {
                "prompts": report["prompts"],
                "tau": {k: r["tau"] for k, r in report["trained"].items()},
                "teacher_forced_acc_0": (report.get("teacher_forced_acc_0") or {}).get("trained"),
            }
        ks = sorted({k for r in rows.values() for k in r["tau"]}, key=int)
        lines = [f"{'set':<16}{'prompts':>8}" + "".join(f"{'k=' + k:>8}" for k in ks) + f"{'acc_0':>8}"]
        lines += [
            f"{name:<16}{r['prompts']:>8}"
            + "".join(f"{r['tau'][k]:>8.3f}" for k in ks)
            + (
                f"{r['teacher_forced_acc_0']:>8.3f}"
                if r["teacher_forced_acc_0"] is not None
                else f"{'n/a':>8}"
            )
            for name, r in rows.items()
        ]
        log.info(
            "evaluate, tau of the trained draft per prompt set (acc_0: its step-0 accuracy teacher-forced "
            "along "
            "the target's answers to that set):\n%s",
            "\n".join(lines),
        )
    out_dir(cfg).mkdir(parents=True, exist_ok=True)
    name = eval_reports.sets_name(bool(cfg.eval.endpoint))
    (out_dir(cfg) / name).write_text(json.dumps(rows, indent=1))
