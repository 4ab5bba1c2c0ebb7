"""The stage runner: runs stages in order, records fingerprints in run_dir/stages.json, skips fresh ones.

Rule (docs/stages.md): a stage is skipped when stages.json holds the same fingerprint for it AND its
output is complete. Otherwise it runs: `prepare` is rebuilt in place; `extract` resumes a store made from
the same inputs and refuses (one line) to touch a store made from other inputs unless
extract.overwrite=true, because features are expensive. A stage's fingerprint covers its own config
section and the fingerprints of what it reads, so a change upstream reaches every stage downstream.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import time
from pathlib import Path

from pipeline import config_limits, ranks
from pipeline.capture import aux_layers, features
from pipeline.commands import ORDER, TOOLS
from pipeline.errors import UserError
from pipeline.formats import check_memo, checkpoint, faults, run_lock
from pipeline.formats import export_layouts as lay
from pipeline.formats import feature_store as fs
from pipeline.formats.run_dir import RunDir
from pipeline.models import targets

log = logging.getLogger(__name__)

# the tools that write into the run dir (parity/, tune/ and the export's serve.sh) take its lock as stages do;
# the others only read and run beside a job
WRITING_TOOLS = ("parity", "tune_serve")


# Stages with a multi-process implementation (torchrun / accelerate launch): extract (hf: data parallel;
# sglang: tensor parallel) and train (DDP). Any other stage on several ranks would write the same files from
# each.
MULTI_RANK = ("extract", "train")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


@contextlib.contextmanager
def one_run(run_dir: Path):
    """One run at a time per run dir (issue #35 rule 2): held from the end of the checks to the end of the
    command; another command there is refused in one line naming the holder. The ranks of one job share it:
    rank 0 holds it for its job (torchrun's run id and rendezvous address), the other ranks wait until it
    does."""
    job = ranks.job()  # torchrun's run id or SLURM's job and step, and the rendezvous address
    if not is_rank0():
        run_lock.wait_for_job(run_dir, job)
        yield
        return
    with run_lock.hold(run_dir, job if world_size() > 1 else None) as lock:
        if lock.took_over:
            log.warning(lock.took_over)
        yield


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
    if not path.exists():
        return {}
    fix = (
        "delete it and rerun the same command: each stage then runs again from its own outputs (prepare and "
        "vocab are rebuilt, extract keeps its committed shards, train resumes from its checkpoints)"
    )
    return faults.read_json(
        path,
        fix,
        lambda v: isinstance(v, dict) and all(isinstance(r, dict) and "fingerprint" in r for r in v.values()),
        "an object of stage records",
    )


def write_record(run_dir: Path, stage: str, record: dict) -> None:
    path = RunDir(Path(run_dir)).stages_json
    records = read_records(run_dir)
    records[stage] = record
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(records, indent=1, sort_keys=True))
    os.replace(tmp, path)


def selected(stage: str) -> list[str]:
    return ORDER if stage == "all" else [stage]


# Set checks that import a library only one stage uses (speculators ~8 s, transformers ~1.5 s of a 2-core
# start, paid by `eaglepipe submit` and by every SLURM job of a chain): judged only where that stage runs, and
# remembered per library version in cache_dir (formats/check_memo), so a submit judges a value again at once
HEAVY_CHECKS = {"train.loss": ("train", "speculators"), "train.schedule": ("train", "transformers")}


def check_judge(cfg, names: list[str] | None):
    """config_limits.problems' judge for a run of `names` (None: every stage's checks)."""

    def judge(key: str, v: str) -> str | None:
        check = config_limits.CHOICES[key]
        if key not in HEAVY_CHECKS:
            return check(key, v)
        stage, lib = HEAVY_CHECKS[key]
        if names is not None and stage not in names:
            return None
        from importlib.metadata import version

        slot = f"{lib}=={version(lib)}"
        return check_memo.judged(cfg.get("cache_dir"), slot, f"{key}={v}", lambda: check(key, v))

    return judge


def preflight(cfg, names: list[str]) -> None:
    """Every selected stage's check(cfg), all before the first stage starts: `stage=all` with a bad eval or
    export setting stops in a second, not after hours of extract and train; every problem in one line.
    Before them: keys the schema lacks, every knob's range or set (config_limits), and the checks across
    stages (aux ids the export's engines cannot serve)."""
    problems = config_limits.unknown_keys(cfg) + config_limits.problems(cfg, check_judge(cfg, names))
    problems += _resume_conflicts(cfg, names) + _unservable_aux_ids(cfg, names)
    mix_heldout = _mix_holds_out(cfg)  # data=mix: train validates on the sources' held-out sets instead
    if {"train", "evaluate"} <= set(names) and cfg.train.val_fraction == 0 and not mix_heldout:
        problems.append(
            "train.val_fraction=0 holds out no samples, and evaluate prompts only from held-out ones: "
            "set train.val_fraction > 0, or run the stages up to export"
        )
    elif (
        {"train", "evaluate"} <= set(names) and (cfg.get("data") or {}).get("limit") == 1 and not mix_heldout
    ):
        problems.append(  # train keeps one sample to train on: 1 x any fraction holds none out
            f"data.limit=1: 1 sample x train.val_fraction={cfg.train.val_fraction} holds none out (training "
            "keeps at least one), and evaluate prompts only from held-out ones: raise data.limit"
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


def _unservable_aux_ids(cfg, names: list[str]) -> list[str]:
    """Aux ids an engine of export.engines cannot be asked for on this target (SGLang on a DeepSeek-V3/Kimi
    target: a first id of 0): refused before capture, not at export after days of extract and train."""
    if not set(names) & {"extract", "vocab", "train", "export"}:
        return []
    try:
        ids = aux_layers.aux_layer_ids(cfg.extract.aux_layers, cfg.target.num_layers)
    except UserError as e:
        return [str(e)]
    arch = targets.declared_architecture(cfg.target) or ""
    found = []
    for engine in [e for e in cfg.export.engines if e in lay.ENGINES]:
        try:
            lay.engine_layer_ids(engine, ids, arch)
        except lay.AuxIdsUnservable as e:
            found.append(f"extract.aux_layers={ids} with export.engines={list(cfg.export.engines)}: {e}")
    return found


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
        with contextlib.ExitStack() as held:  # the run dir's lock, taken by _run_stages once the checks pass
            _run_stages(cfg, stage, held)
    except fs.Damaged as e:  # damaged features, found while reading them (the message names the fix)
        raise UserError(str(e)) from None
    except UserError:
        raise
    except Exception as e:  # a full disk, in whichever words the writer says it
        if (line := faults.disk_full(e, cfg.run_dir)) is None:
            raise
        raise UserError(line) from None


def _up_to_date(cfg, run_dir: Path, name: str) -> tuple[str, dict | None, bool]:
    """A stage's fingerprint, its record, and whether it is up to date (the same fingerprint recorded, and
    its output complete): the one rule of stage=all's skipping and of `eaglepipe submit`'s."""
    module = importlib.import_module(f"pipeline.stages.{name}")
    fp = module.fingerprint(cfg)
    old = read_records(run_dir).get(name)
    return fp, old, bool(old and old["fingerprint"] == fp and module.is_complete(cfg))


def _submit(cfg) -> None:
    """`eaglepipe submit`: the stages not up to date as a chain of SLURM jobs (cluster/chain.py), after the
    same checks stage=all runs first (this node's CUDA aside: the jobs run on others)."""
    from hydra.core.hydra_config import HydraConfig

    from pipeline import __version__
    from pipeline.cluster import chain

    if not HydraConfig.initialized():
        raise UserError("submit runs from the command line: eaglepipe submit <the overrides of stage=all>")
    names = [n for n in ORDER if not (n == "extract" and features.online(cfg))]
    chain.partition_nodes(cfg)  # the cluster answers and has the partition: a second, not preflight's seconds
    with config_limits.checking_for_another_node():
        preflight(cfg, names)
    run_dir = Path(cfg.run_dir)
    stale = []
    for name in names:  # the first stage not up to date, and every one after it
        if stale or not run_dir.is_dir():
            stale.append(name)
            continue
        try:
            fresh = _up_to_date(cfg, run_dir, name)[2]
        except (UserError, OSError, ValueError, KeyError):  # its inputs are not there yet
            fresh = False
        if not fresh:
            stale.append(name)
    skip = ("stage=", "hydra/launcher=", "hydra.launcher.", "submit.wait=")
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith(skip)]
    jobs = chain.submit(cfg, stale, names, overrides, __version__, MULTI_RANK)
    if cfg.submit.wait and jobs:
        chain.follow(run_dir, jobs, float(cfg.submit.poll_s))


def _run_stages(cfg, stage: str, held: contextlib.ExitStack) -> None:
    if stage == "submit":
        return _submit(cfg)
    if stage in TOOLS:
        if problems := config_limits.unknown_keys(cfg) + config_limits.problems(cfg):
            raise UserError("; ".join(problems))
        if stage in WRITING_TOOLS:
            Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
            held.enter_context(one_run(Path(cfg.run_dir)))
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
    held.enter_context(one_run(run_dir))
    ran = set()
    for name in names:
        module = importlib.import_module(f"pipeline.stages.{name}")
        fp, old, fresh = _up_to_date(cfg, run_dir, name)
        if fresh:
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
