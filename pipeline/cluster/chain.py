"""The pipeline as a SLURM job graph: `eaglepipe submit ...` (issue #38; docs/scale.md).

Each stage that is not up to date becomes one batch job, chained to the one before it with
`--dependency=afterok:<id>` and `--kill-on-invalid-dep=yes` (a failed job's dependents are cancelled by SLURM,
never left pending). extract and train run `submit.ranks` tasks (srun starts them; pipeline/ranks.py turns
SLURM's task variables into torch.distributed's); the other stages one. Every job runs `python -m pipeline
stage=<its stage>` with the submitting command's own overrides, from the submitting directory, with its
environment.

Preemption: each job asks SLURM for SIGUSR2 `submit.signal_delay_s` before its time limit
(`--signal=B:USR2@N`, to the batch shell, which hands it to srun, which hands it to every task); training
checkpoints at the next optimizer step and requeues its own job (training/preemption.py); a job requeued
without warning (`scontrol requeue`) resumes from the newest checkpoint.

Submitting again asks SLURM for the recorded jobs (run_dir/cluster/jobs.json): a stage up to date is skipped,
a job still pending or running with the same overrides is kept (the next stages chain onto it), the rest are
submitted. Nothing is submitted until every stage's request fits a node of the partition.
"""

from __future__ import annotations

import logging
import shlex
import sys
import time
from pathlib import Path

from pipeline.cluster import slurm
from pipeline.errors import UserError
from pipeline.formats import cluster_jobs

log = logging.getLogger(__name__)
REQUEUE_ENV = "EAGLEPIPE_SLURM_REQUEUE"  # set in the job scripts: training requeues its own job on SIGUSR2


def request(cfg, stage: str, multi_rank) -> dict:
    """What a stage's job asks SLURM for: the stages that run on several ranks get submit.ranks tasks."""
    s = cfg.submit
    ranks = int(s.ranks) if stage in multi_rank else 1
    return {
        "ranks": ranks,
        "cpus_per_rank": int(s.cpus_per_rank),
        "gpus_per_rank": int(s.gpus_per_rank),
        "mem_gb": int(s.mem_gb_per_rank) * ranks,
        "time_min": int(s.time_min[stage]),
    }


def partition_nodes(cfg) -> list[dict]:
    """submit.partition's nodes; a partition that does not exist is one line. `eaglepipe submit` asks first,
    before the checks that import the stages' libraries (seconds), and again before it submits."""
    part = cfg.submit.partition
    if not (nodes := slurm.nodes(part)):
        known = ", ".join(slurm.partitions()) or "none"
        which = f"partition {part} does not exist" if part else "the cluster has no default partition"
        raise UserError(f"{which} (sinfo lists: {known}): set submit.partition")
    return nodes


def check_fits(cfg, stages: list[str], multi_rank) -> None:
    """Every job's request against the partition's nodes, before anything is submitted."""
    part, nodes = cfg.submit.partition, partition_nodes(cfg)
    best = {k: max(n[k] for n in nodes) for k in ("cpus", "gpus", "mem_mb")}
    bad = []
    for stage in stages:
        r = request(cfg, stage, multi_rank)
        cpus, gpus, mem = r["ranks"] * r["cpus_per_rank"], r["ranks"] * r["gpus_per_rank"], r["mem_gb"] * 1024
        if cpus > best["cpus"] or gpus > best["gpus"] or mem > best["mem_mb"]:
            bad.append(f"{stage} asks for {cpus} CPUs, {gpus} GPUs, {r['mem_gb']} GB on one node")
    if bad:
        raise UserError(
            f"{'; '.join(bad)}: the largest node of {part or 'the default partition'} has "
            f"{best['cpus']} CPUs, "
            f"{best['gpus']} GPUs, {best['mem_mb'] // 1024} GB; lower submit.ranks, submit.cpus_per_rank, "
            "submit.gpus_per_rank or submit.mem_gb_per_rank (nothing was submitted)"
        )


def script(cfg, stage: str, overrides: list[str], after: str | None, multi_rank) -> str:
    r, s, run_dir = request(cfg, stage, multi_rank), cfg.submit, Path(cfg.run_dir).resolve()
    lines = [
        "#!/bin/bash",
        f"# written by `eaglepipe submit` for stage {stage} of {run_dir}",
        f"#SBATCH --job-name=eaglepipe-{stage}",
        f"#SBATCH --output={cluster_jobs.log_path(run_dir, stage)}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --ntasks={r['ranks']}",
        "#SBATCH --nodes=1",
        f"#SBATCH --cpus-per-task={r['cpus_per_rank']}",
        f"#SBATCH --mem={r['mem_gb']}G",
        f"#SBATCH --time={r['time_min']}",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR2@{int(s.signal_delay_s)}",
    ]
    if r["gpus_per_rank"]:
        lines.append(f"#SBATCH --gpus-per-task={r['gpus_per_rank']}")
    for key in ("partition", "account", "qos"):
        if s[key]:
            lines.append(f"#SBATCH --{key}={s[key]}")
    if after:
        lines += [f"#SBATCH --dependency=afterok:{after}", "#SBATCH --kill-on-invalid-dep=yes"]
    command = shlex.join([sys.executable, "-m", "pipeline", f"stage={stage}", *overrides])
    lines += [
        f"cd {shlex.quote(str(Path.cwd()))}",
        f"export {REQUEUE_ENV}=1",
        # the job's task count now: a requeued job may have been given another (elastic resume); the
        # environment keeps the one it was submitted with
        "ntasks=$(scontrol show job -o \"$SLURM_JOB_ID\" | sed -n 's/.* NumTasks=\\([0-9]*\\).*/\\1/p')",
        "ntasks=${ntasks:-$SLURM_NTASKS}",
        'echo "eaglepipe: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $(hostname): '
        f'{stage}, $ntasks task(s)"',
        # the batch shell gets SLURM's warning (B:); srun hands USR2 on to every task
        f'srun --kill-on-bad-exit=1 --ntasks="$ntasks" {command} &',
        "child=$!",
        "trap 'kill -USR2 $child 2>/dev/null' USR2",
        "while :; do wait $child; rc=$?; kill -0 $child 2>/dev/null || break; done",
        "exit $rc",
    ]
    return "\n".join(lines) + "\n"


def in_flight(state: dict | None) -> bool:
    """A job that will still run (or runs); one whose dependency can never be met will not."""
    state = state or {}
    return state.get("JobState") in slurm.IN_FLIGHT and "DependencyNeverSatisfied" not in state.get(
        "Reason", ""
    )


def submit(cfg, stale: list[str], order: list[str], overrides: list[str], version: str, multi_rank) -> dict:
    """Submit the stale stages as a chain; stage -> its entry (the in-flight jobs kept included)."""
    run_dir = Path(cfg.run_dir).resolve()
    recorded = cluster_jobs.read(run_dir)
    states = slurm.jobs([recorded[s]["job_id"] for s in stale if s in recorded])
    keep = {}
    for stage in stale:  # the leading jobs still pending or running: the new ones chain onto them
        old = recorded.get(stage)
        if not old or not in_flight(states.get(old["job_id"])):
            break
        if old.get("overrides") != overrides:
            raise UserError(
                f"{stage}: job {old['job_id']} is still {states[old['job_id']]['JobState']} with other "
                "settings: "
                f"wait for it or cancel it (scancel {old['job_id']}), then submit again"
            )
        keep[stage] = old
    todo = [s for s in stale if s not in keep]
    for stage in todo:
        old = recorded.get(stage)
        if old and in_flight(states.get(old["job_id"])):
            raise UserError(
                f"{stage}: job {old['job_id']} is still {states[old['job_id']]['JobState']} but an earlier "
                f"stage is not: cancel it (scancel {old['job_id']}) and submit again"
            )
    if todo:
        check_fits(cfg, todo, multi_rank)
    after = list(keep.values())[-1]["job_id"] if keep else None
    entries = dict(recorded)
    for stage in todo:
        path = cluster_jobs.folder(run_dir) / f"{stage}.sbatch"
        (path.parent / "logs").mkdir(parents=True, exist_ok=True)
        path.write_text(script(cfg, stage, overrides, after, multi_rank))
        job_id = slurm.sbatch(path, f"stage {stage}")
        entries[stage] = {
            "job_id": job_id,
            "after": after,
            "overrides": overrides,
            "ranks": request(cfg, stage, multi_rank)["ranks"],
            "script": str(path),
            "log": str(cluster_jobs.log_path(run_dir, stage)).replace("%j", job_id),
            "submitted_at": time.strftime("%FT%T"),
        }
        cluster_jobs.write(
            run_dir, entries, version
        )  # after each job: a failure later leaves none unrecorded
        after = job_id
    for stage in order:
        if stage not in stale:
            log.info("submit: %-8s up to date", stage)
        elif stage in keep:
            log.info("submit: %-8s job %s kept (%s)", stage, keep[stage]["job_id"], line(states, keep[stage]))
        else:
            e = entries[stage]
            log.info(
                "submit: %-8s job %s submitted, %d task(s), log %s", stage, e["job_id"], e["ranks"], e["log"]
            )
    if not stale:
        log.info("submit: every stage is up to date; nothing submitted")
    return {s: entries[s] for s in stale}


def line(states: dict, entry: dict) -> str:
    st = states.get(entry["job_id"], {})
    restarts = f", requeued {st['Restarts']}x" if st.get("Restarts", "0") != "0" else ""
    return f"{st.get('JobState', '?')}{restarts}"


ENDED = slurm.ENDED_BADLY | {"UNKNOWN"}


def first_ended_badly(order: list[str], chain: dict[str, dict], states: dict) -> str | None:
    return next((s for s in order if states[chain[s]["job_id"]].get("JobState") in ENDED), None)


def cause(
    order: list[str], chain: dict[str, dict], poll_s: float, ask=slurm.jobs, settle_s: float = 60.0
) -> tuple[str, dict]:
    """The stage whose job ended the chain, read after SLURM's cascade settles.

    --kill-on-invalid-dep cancels a failed job's dependents while that job may still show COMPLETING, and
    scontrol is asked one job at a time: one pass can see evaluate CANCELLED before it sees prepare FAILED. So
    the jobs are asked again (after the dependents' cancel, by causality, the failure that caused it shows),
    and again while a job before the first one that ended badly still shows COMPLETING (for at most
    settle_s). `ask`: ids -> states (slurm.jobs)."""
    ids = [chain[s]["job_id"] for s in order]
    deadline = time.monotonic() + settle_s
    while True:
        states = ask(ids)
        stage = first_ended_badly(order, chain, states)
        before = order[: order.index(stage)] if stage else order
        completing = any(states[chain[s]["job_id"]].get("JobState") == "COMPLETING" for s in before)
        if stage and (not completing or time.monotonic() > deadline):
            return stage, states
        time.sleep(poll_s)


def follow(run_dir: Path, chain: dict[str, dict], poll_s: float, ask=slurm.jobs) -> None:
    """Until the chain ends: one line per change of a job's state; a job that ends badly names its log, its
    still-waiting dependents are cancelled and the line says how to go on."""
    seen: dict[str, tuple] = {}
    order = list(chain)

    def show(states: dict) -> None:
        for stage in order:
            e = chain[stage]
            now = (states[e["job_id"]].get("JobState"), states[e["job_id"]].get("Restarts", "0"))
            if seen.get(stage) != now:
                seen[stage] = now
                log.info("submit: %-8s job %s %s", stage, e["job_id"], line(states, e))

    while True:
        states = ask([e["job_id"] for e in chain.values()])
        show(states)
        if first_ended_badly(order, chain, states):
            stage, states = cause(order, chain, poll_s, ask)
            show(states)
            e, st = chain[stage], states[chain[stage]["job_id"]]
            rest = [chain[s]["job_id"] for s in order[order.index(stage) + 1 :]]
            slurm.cancel([j for j in rest if states[j].get("JobState") in slurm.IN_FLIGHT])
            raise UserError(
                f"stage {stage}: job {e['job_id']} {st.get('JobState')} (exit {st.get('ExitCode', '?')}); "
                f"its log: {e['log']}; {len(rest)} job(s) after it cancelled ({', '.join(rest) or 'none'}); "
                "fix it and submit again (the stages that finished are not redone)"
            )
        if all(states[e["job_id"]].get("JobState") == "COMPLETED" for e in chain.values()):
            log.info("submit: the chain finished (%d job(s)) in %s", len(chain), run_dir)
            return
        time.sleep(poll_s)
