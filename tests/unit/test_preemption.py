"""train's Preemption (SLURM's warning signal under submitit): it only flags the signal; the loop hands it to
submitit's handler once, after a checkpoint; a signal after the loop is handed on at close; outside submitit
nothing is installed. The handler standing in for submitit's records its calls."""

import os
import signal
from types import SimpleNamespace

import pytest

from pipeline.training.preemption import Preemption

ONE_RANK = SimpleNamespace(num_processes=1)


@pytest.fixture
def submitit(monkeypatch):
    calls = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    yield calls
    signal.signal(signal.SIGUSR2, previous)


def test_the_signal_is_flagged_then_handed_to_submitit_once(submitit):
    p = Preemption()
    assert not p.due(ONE_RANK)
    os.kill(os.getpid(), signal.SIGUSR2)
    assert p.due(ONE_RANK) and submitit == []  # flagged only: the loop checkpoints first
    p.hand_over()
    assert submitit == [signal.SIGUSR2]
    p.close()
    assert submitit == [signal.SIGUSR2]  # not twice


def test_a_signal_after_the_loop_is_handed_on_at_close_and_the_handler_restored(submitit):
    p = Preemption()
    os.kill(os.getpid(), signal.SIGUSR2)
    p.close()
    assert submitit == [signal.SIGUSR2]
    os.kill(os.getpid(), signal.SIGUSR2)  # submitit's own handler again
    assert submitit == [signal.SIGUSR2, signal.SIGUSR2]


def test_outside_submitit_nothing_is_installed(monkeypatch):
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    before = signal.getsignal(signal.SIGUSR2)
    p = Preemption()
    assert signal.getsignal(signal.SIGUSR2) is before and not p.due(ONE_RANK)
    p.close()
