"""Which rank this process is, read one way whoever started it (issue #38).

torchrun and `accelerate launch` set torch.distributed's variables themselves (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). A task of an `srun` step with several tasks (an sbatch script's
`srun --ntasks=N`, or Hydra's submitit launcher with `tasks_per_node: N`) has only SLURM's: `from_slurm` turns
those into torch.distributed's, once, before anything reads them, so every reader after it (the runner,
accelerate, capture's shard dealing) sees one layout whatever the launcher:

  RANK = SLURM_PROCID, WORLD_SIZE = SLURM_STEP_NUM_TASKS, LOCAL_RANK = SLURM_LOCALID, LOCAL_WORLD_SIZE = this
  node's count in SLURM_STEP_TASKS_PER_NODE, MASTER_ADDR = the first host of SLURM_STEP_NODELIST,
  MASTER_PORT = 10000 + SLURM_JOB_ID % 20000 (each job its own port; a rendezvous given by the user is kept).

A batch script itself (no srun step: SLURM_STEP_NUM_TASKS unset) and a one-task step are one process.
"""

from __future__ import annotations

import os
import re

FROM = "EAGLEPIPE_RANKS_FROM"  # set by from_slurm: who the layout came from, for the log and train_summary
PORT_BASE, PORT_SPAN = 10000, 20000


def from_slurm(env=os.environ) -> bool:
    """Fill torch.distributed's variables from SLURM's in a task of a multi-task srun step, unless a launcher
    (torchrun, accelerate) set them already. True: they were filled here (now or by a parent process)."""
    if env.get(FROM) == "slurm":
        return True
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or 1)
    if "RANK" in env or "SLURM_PROCID" not in env or tasks < 2:
        return False
    node = int(env.get("SLURM_NODEID") or 0)
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = str(tasks)
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "")
    env["LOCAL_WORLD_SIZE"] = str(per_node[node] if node < len(per_node) else tasks)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "localhost"
    env.setdefault("MASTER_ADDR", first_host(nodelist))
    env.setdefault("MASTER_PORT", str(PORT_BASE + int(env.get("SLURM_JOB_ID") or 0) % PORT_SPAN))
    env[FROM] = "slurm"
    return True


def first_host(nodelist: str) -> str:
    """The first host of SLURM's compact host list: `vm` -> vm, `gpu[07-09,12],cpu3` -> gpu07,
    `rack[1-2]-n[3-4]` -> rack1-n3 (each bracket's first value; SLURM expands brackets as a product)."""
    head = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist.strip())  # up to the first comma outside brackets
    if not head:
        return "localhost"
    return re.sub(r"\[([^\]\-,]*)[^\]]*\]", r"\1", head.group(0))


def tasks_per_node(spec: str) -> list[int]:
    """SLURM's tasks-per-node form, one count per node: `2(x3),1` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m:
            counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def launcher(env=os.environ) -> str:
    """Who started the ranks: slurm (srun's tasks), accelerate, torchrun, or one process."""
    if env.get(FROM) == "slurm":
        return "slurm"
    if "RANK" not in env and "LOCAL_RANK" not in env:
        return "one process"
    return "accelerate" if any(k.startswith("ACCELERATE_") for k in env) else "torchrun"


def layout(env=os.environ) -> dict:
    """How the ranks of this job are laid out: train_summary.json's `rank_layout` (beside world_size)."""
    world = int(env.get("WORLD_SIZE") or 1)
    local = int(env.get("LOCAL_WORLD_SIZE") or world)
    out = {
        "launcher": launcher(env),
        "nodes": max(world // max(local, 1), 1),
        "ranks_per_node": local,
        "rendezvous": None,
    }
    if world > 1 and "MASTER_ADDR" in env:
        out["rendezvous"] = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT')}"
    if "SLURM_JOB_ID" in env:
        out["slurm_job_id"] = env["SLURM_JOB_ID"]
    return out


def job(env=os.environ) -> str:
    """This multi-rank job's identity, the same on each of its ranks and another for the next job (the run
    dir's lock: rank 0 holds it for the job, the other ranks wait for this name): torchrun's run id, or
    SLURM's job, step and requeue count; and the rendezvous address."""
    if env.get(FROM) == "slurm":
        run = "slurm-{}.{}.r{}".format(
            env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID"), env.get("SLURM_RESTART_COUNT", "0")
        )
    else:
        run = env.get("TORCHELASTIC_RUN_ID")
    return f"{run}@{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"


def describe(env=os.environ) -> str:
    """The one log line of the layout."""
    lay = layout(env)
    where = f"; rendezvous {lay['rendezvous']}" if lay["rendezvous"] else ""
    job_id = f" (SLURM job {lay['slurm_job_id']})" if lay["launcher"] == "slurm" else ""
    return (
        f"ranks: {env.get('WORLD_SIZE', '1')} from {lay['launcher']}{job_id}: {lay['nodes']} node(s) x "
        f"{lay['ranks_per_node']} rank(s){where}"
    )
