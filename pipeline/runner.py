"""The stage runner: runs stages in order, records fingerprints in run_dir/stages.json, skips fresh ones.

Rule (docs/stages.md): a stage is skipped when stages.json holds the same fingerprint for it AND its
output is complete. Otherwise it runs: `prepare` is rebuilt in place; `extract` resumes a store made from
the same inputs and refuses (one line) to touch a store made from other inputs unless
extract.overwrite=true, because features are expensive. A stage's fingerprint covers its own config
section and the fingerprints of what it reads, so a change upstream reaches every stage downstream.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import time
from pathlib import Path

from pipeline.capture import features
from pipeline.errors import UserError
from pipeline.formats import checkpoint
from pipeline.formats import feature_store as fs
from pipeline.formats.run_dir import RunDir

log = logging.getLogger(__name__)

ORDER = ["prepare", "extract", "vocab", "train", "export", "evaluate"]
# read an export or a store; no fingerprints, never part of `all`
TOOLS = ["verify", "serve", "doctor", "parity", "check_store", "plan", "tune_serve"]


# Stages with a multi-process implementation (torchrun / accelerate launch): extract (hf: data parallel;
# sglang: tensor parallel) and train (DDP). Any other stage on several ranks would write the same files from
# each.
MULTI_RANK = ("extract", "train")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


# What each stage read (run_dir-relative): a stage skipped as up to date says so when one of them is gone
_R = RunDir(Path())  # run_dir-relative names of the artifacts
INPUTS = {
    "extract": [str(_R.prepared_stats)],
    "vocab": [str(_R.features_manifest)],
    "train": [str(_R.features_manifest), str(_R.vocab_manifest)],
    "export": [str(_R.final / "model.safetensors"), str(_R.features_manifest), str(_R.vocab_manifest)],
    "evaluate": [str(_R.export_manifest("sglang")), str(_R.features_manifest)],
}


def read_records(run_dir: Path) -> dict:
    path = RunDir(Path(run_dir)).stages_json
    return json.loads(path.read_text()) if path.exists() else {}


def write_record(run_dir: Path, stage: str, record: dict) -> None:
    path = RunDir(Path(run_dir)).stages_json
    records = read_records(run_dir)
    records[stage] = record
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(records, indent=1, sort_keys=True))
    os.replace(tmp, path)


def selected(stage: str) -> list[str]:
    return ORDER if stage == "all" else [stage]


def preflight(cfg, names: list[str]) -> None:
    """Every selected stage's check(cfg), all before the first stage starts: `stage=all` with a bad eval or
    export setting stops in a second, not after hours of extract and train; every problem in one line."""
    problems = _resume_conflicts(cfg, names)
    mix_heldout = _mix_holds_out(cfg)  # data=mix: train validates on the sources' held-out sets instead
    if {"train", "evaluate"} <= set(names) and cfg.train.val_fraction == 0 and not mix_heldout:
        problems.append(
            "train.val_fraction=0 holds out no samples, and evaluate prompts only from held-out ones: "
            "set train.val_fraction > 0, or run the stages up to export"
        )
    for name in names:
        check = getattr(importlib.import_module(f"pipeline.stages.{name}"), "check", None)
        if check is None:
            continue
        try:
            check(cfg)
        except UserError as e:
            problems.append(f"{name}: {e}")
    if problems:
        raise UserError("; ".join(problems))


def _mix_holds_out(cfg) -> bool:
    data = cfg.get("data") or {}
    fmt = data.get("format")
    return str(getattr(fmt, "value", fmt)) == "mix" and any(
        s.get("heldout", 0) > 0 for s in data.get("sources") or []
    )


def _resume_conflicts(cfg, names: list[str]) -> list[str]:
    """A vocab rebuilt at another size under checkpoints that train would resume (#12 B3): refused before the
    vocab is replaced, instead of a size mismatch inside load_state after it was."""
    if (
        not {"vocab", "train"} <= set(names)
        or str(getattr(cfg.train.resume, "value", cfg.train.resume)) != "auto"
    ):
        return []
    vocab_manifest = RunDir.of(cfg).vocab_manifest
    train_dir = RunDir.of(cfg).train
    if not vocab_manifest.is_file() or checkpoint.latest(train_dir) is None:
        return []
    built = json.loads(vocab_manifest.read_text()).get("draft_vocab_size")
    if built == cfg.vocab.draft_vocab_size:
        return []
    return [
        (
            f"vocab.draft_vocab_size={cfg.vocab.draft_vocab_size} would rebuild {vocab_manifest.parent} (now "
            f"{built} tokens) under the checkpoints in {train_dir}, trained with {built}, which "
            "train.resume=auto "
            "cannot resume: add train.resume=never to train from scratch (it replaces them) or use a new "
            "run_dir"
        )
    ]


def run_stages(cfg) -> None:
    stage = str(getattr(cfg.stage, "value", cfg.stage))
    # httpx logs every request at INFO: a regeneration or an online bench sends tens of thousands; their
    # counts and rates are our own log lines
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        _run_stages(cfg, stage)
    except fs.ChunkError as e:  # damaged features, found while reading them
        raise UserError(str(e)) from None


def _run_stages(cfg, stage: str) -> None:
    if stage in TOOLS:
        importlib.import_module(f"pipeline.tools.{stage}").run(cfg)
        return
    names = selected(stage)
    if features.online(cfg):
        if stage == "extract":
            raise UserError(
                "train.features=online writes no feature store: train computes the states itself; run "
                "stage=train (or stage=all), or set train.features=offline to extract a store"
            )
        if "extract" in names:
            log.info("stage extract: skipped, train.features=online (train runs the target on each pack)")
            names = [n for n in names if n != "extract"]
    if world_size() > 1 and [n for n in names if n not in MULTI_RANK]:
        raise UserError(
            f"stage={stage} on {world_size()} ranks: only {' and '.join(MULTI_RANK)} run on several ranks "
            "(torchrun / accelerate launch); run the other stages in one process (docs/scale.md)"
        )
    preflight(cfg, names)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ran = set()
    for name in names:
        module = importlib.import_module(f"pipeline.stages.{name}")
        fp = module.fingerprint(cfg)
        old = read_records(run_dir).get(name)
        if old and old["fingerprint"] == fp and module.is_complete(cfg):
            log.info("stage %s: up to date (fingerprint %s), skipped", name, fp)
            gone = [
                p
                for p in INPUTS.get(name, ())
                if not (run_dir / p).exists() and not (features.online(cfg) and p.startswith("features/"))
            ]
            if gone:
                log.warning(
                    "stage %s: its output is up to date, but %d of its inputs are gone (%s): stages that "
                    "read "
                    "them fail until they are rebuilt (stage=all rebuilds them)",
                    name,
                    len(gone),
                    ", ".join(str(run_dir / p) for p in gone),
                )
            continue
        if old and old["fingerprint"] != fp:
            log.info(
                "stage %s: inputs changed since the last run (%s -> %s): running again",
                name,
                old["fingerprint"],
                fp,
            )
        t0 = time.time()
        out = module.run(cfg)
        if not is_rank0():  # rank 0 records the stage, once (it finishes last: both stages end at a barrier)
            continue
        write_record(
            run_dir,
            name,
            {
                "fingerprint": fp,
                "output": str(out),
                "seconds": round(time.time() - t0, 1),
                "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            },
        )
        log.info("stage %s: done in %.1f s -> %s", name, time.time() - t0, out)
        ran.add(name)
    if stage == "all" and is_rank0():
        from pipeline.formats import summary

        summary.report(run_dir, ORDER, ran)
