"""SLURM's own commands (sbatch, scontrol, scancel, sinfo), each failure one line naming the fix (issue #38).

Nothing here knows the pipeline: the job graph (cluster/chain.py) says what to submit, this module asks SLURM.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from pipeline.errors import UserError

LOCAL_CLUSTER = "tests/slurm_local.sh up starts a one-node cluster on this machine"
# states in which a job will still run (or runs): a submission again chains onto it instead of duplicating it
IN_FLIGHT = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SUSPENDED",
    "SIGNALING",
    "STAGE_OUT",
    "STOPPED",
}
ENDED_BADLY = {
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def cli(args: list[str], what: str = "") -> str:
    """stdout of a SLURM command; its failure as one line."""
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise UserError(
            f"{args[0]} not found: SLURM's client commands are not installed on this node (Debian: apt-get "
            f"install slurm-client; or submit from the cluster's login node); {LOCAL_CLUSTER}"
        ) from None
    except subprocess.TimeoutExpired:
        raise UserError(
            f"{args[0]} did not answer in 60 s: slurmctld is down or overloaded (scontrol ping)"
        ) from None
    if r.returncode == 0:
        return r.stdout
    err = " ".join(r.stderr.split()) or f"exit {r.returncode}"
    if re.search(r"Unable to contact slurm controller|Connection refused|Socket timed out|Zero Bytes", err):
        raise UserError(
            f"slurmctld does not answer ({args[0]}: {err}): start it (systemctl start slurmctld; "
            f"{LOCAL_CLUSTER}) "
            "and submit again"
        )
    if "invalid partition" in err.lower():
        raise UserError(
            f"{what}: the partition does not exist ({err}); set submit.partition to one `sinfo` lists"
        )
    if "node configuration is not available" in err:
        raise UserError(
            f"{what}: asks for more than any node of the partition has ({err}); lower submit.ranks, "
            "submit.cpus_per_rank, submit.gpus_per_rank or submit.mem_gb_per_rank (sinfo -N -l shows the "
            "nodes)"
        )
    raise UserError(f"{' '.join(args[:2])} failed{' for ' + what if what else ''}: {err}")


def nodes(partition: str | None) -> list[dict]:
    """The nodes of a partition (null: the default one): name, cpus, memory (MB), gpus, partition."""
    out = cli(["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G|%T"], "sinfo")
    rows = []
    for line in out.splitlines():
        name, part, cpus, mem, gres, state = line.split("|")
        default = part.endswith("*")
        part = part.rstrip("*")
        if (partition is None and not default) or (partition is not None and part != partition):
            continue
        gpus = sum(int(n) for n in re.findall(r"gpu(?::[^:(,]+)?:(\d+)", gres))
        rows.append({"name": name, "partition": part, "cpus": int(cpus), "mem_mb": int(mem), "gpus": gpus})
    return rows


def partitions() -> list[str]:
    out = cli(["sinfo", "-h", "-o", "%P"], "sinfo")
    return sorted({p.strip().rstrip("*") for p in out.split()})


def sbatch(script: Path, what: str) -> str:
    """Submit a batch script; its job id."""
    out = cli(["sbatch", "--parsable", str(script)], what)
    return out.strip().split(";")[0]


def jobs(ids: list[str]) -> dict[str, dict]:
    """id -> scontrol's fields of that job (JobState, Reason, Restarts, ExitCode, StdOut, NumTasks, ...); a
    job SLURM no longer knows (purged after MinJobAge) -> {"JobState": "UNKNOWN"}."""
    out: dict[str, dict] = {}
    for job_id in ids:
        try:
            text = cli(["scontrol", "show", "job", "-o", job_id], f"job {job_id}")
        except UserError as e:
            if "Invalid job id" not in str(e):
                raise
            out[job_id] = {"JobState": "UNKNOWN"}
            continue
        out[job_id] = fields(text)
    return out


def fields(text: str) -> dict:
    """scontrol's one-line `Key=Value Key=Value ...` form as a dict (values may hold spaces only in the last
    keys, Command/WorkDir/StdOut: taken up to the next ` Key=`)."""
    return dict(re.findall(r"(\w[\w:/]*)=(.*?)(?=\s+\w[\w:/]*=|\s*$)", text.strip()))


def cancel(ids: list[str]) -> None:
    if ids:
        cli(["scancel", *ids], "scancel")


def requeue(job_id: str) -> None:
    cli(["scontrol", "requeue", job_id], f"job {job_id}")
