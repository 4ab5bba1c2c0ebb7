"""SLURM's warning signal before a preemption or time limit, under submitit."""

from __future__ import annotations

import logging
import os
import signal

import torch

log = logging.getLogger(__name__)


class Preemption:
    """A job under submitit (hydra/launcher=slurm|local): SLURM's warning signal before a time limit or a
    preemption (SIGUSR2, or SUBMITIT_PREEMPT_SIGNAL) only sets a flag here; the loop writes a checkpoint at
    the next optimizer step and then hands the signal to submitit's own handler, which requeues the job (same
    overrides, same run dir) and exits; the requeued job resumes from that checkpoint. Outside submitit
    nothing is installed. On several ranks the flag is agreed on (a max over ranks) once per optimizer
    step."""

    def __init__(self):
        self.requested, self.previous = False, None
        if "SUBMITIT_EXECUTOR" not in os.environ:
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
        else:  # SIG_DFL / SIG_IGN: nothing of submitit's to hand to; stop so a restart resumes
            raise SystemExit(f"train: preemption signal {self.signum}: checkpoint written, stopping")
