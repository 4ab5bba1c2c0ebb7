"""SLURM's warning signal before a preemption or time limit: under submitit, or in a job of `eaglepipe
submit`'s chain (which requeues itself)."""

from __future__ import annotations

import logging
import os
import signal
import time

import torch

from pipeline.cluster import slurm
from pipeline.cluster.chain import REQUEUE_ENV

log = logging.getLogger(__name__)
REQUEUE_WAIT_S = 300  # SLURM stops a requeued job's tasks within KillWait (30 s by default)


class Preemption:
    """A job under submitit (hydra/launcher=slurm|local): SLURM's warning signal before a time limit or a
    preemption (SIGUSR2, or SUBMITIT_PREEMPT_SIGNAL) only sets a flag here; the loop writes a checkpoint at
    the next optimizer step and then hands the signal to submitit's own handler, which requeues the job (same
    overrides, same run dir) and exits; the requeued job resumes from that checkpoint. In a job of
    `eaglepipe submit` (REQUEUE_ENV set by its script) rank 0 requeues the job itself (`scontrol requeue`).
    Elsewhere nothing is installed. On several ranks the flag is agreed on (a max over ranks) once per
    optimizer step."""

    def __init__(self):
        self.requested, self.previous = False, None
        self.own_job = os.environ.get(REQUEUE_ENV) == "1" and "SLURM_JOB_ID" in os.environ
        if "SUBMITIT_EXECUTOR" not in os.environ and not self.own_job:
            return
        self.signum = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper())
        self.previous = signal.getsignal(self.signum)
        signal.signal(self.signum, self._flag)

    def _flag(self, signum, frame) -> None:
        self.requested = True

    def due(self, accelerator) -> bool:
        if self.previous is None:
            return False
        if accelerator.num_processes == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=accelerator.device)
        return float(accelerator.reduce(flag, reduction="sum")) > 0

    def close(self) -> None:
        """The loop is over: submitit's handler back; a signal that came after the last checkpoint is handed
        on
        now (the requeued job resumes at the end and only finishes)."""
        if self.previous is None:
            return
        signal.signal(self.signum, self.previous)
        if self.requested and callable(self.previous):
            self.previous(self.signum, None)

    def hand_over(self) -> None:
        previous, self.previous = self.previous, None  # handed on once: close() has nothing left to do
        signal.signal(self.signum, previous)
        if callable(previous):
            previous(self.signum, None)  # submitit: checkpoint() -> requeue -> exit
        elif self.own_job:  # SLURM stops every task of the job and starts the batch script again
            if int(os.environ.get("RANK", "0")) == 0:
                log.warning("train: requeueing SLURM job %s", os.environ["SLURM_JOB_ID"])
                slurm.requeue(os.environ["SLURM_JOB_ID"])
            # no task exits first: an exit (the job's end) racing the requeue would end the job as FAILED
            time.sleep(REQUEUE_WAIT_S)
            raise SystemExit(f"train: preemption signal {self.signum}: job requeued, SLURM did not stop it")
        else:  # SIG_DFL / SIG_IGN: nothing of submitit's to hand to; stop so a restart resumes
            raise SystemExit(f"train: preemption signal {self.signum}: checkpoint written, stopping")
