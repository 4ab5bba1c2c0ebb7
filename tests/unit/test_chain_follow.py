"""`eaglepipe submit submit.wait=true` names the job that ended the chain, not the last one SLURM cancelled.

The states below are the ones CI's real SLURM gave (stop 45, job ids 7-12): follow() asked scontrol one job at
a time; prepare still showed RUNNING when asked, then failed, and --kill-on-invalid-dep had cancelled evaluate
by the time it was asked. The real cluster's run of this path is tests/integration/test_slurm.py; here the
scontrol answers are replayed (the SLURM boundary), so the interleaving that CI met once is met every time.
"""

from __future__ import annotations

import pytest

from pipeline.cluster import chain
from pipeline.errors import UserError

ORDER = ["prepare", "extract", "vocab", "train", "export", "evaluate"]
CHAIN = {s: {"job_id": str(7 + i), "log": f"logs/{s}-{7 + i}.log"} for i, s in enumerate(ORDER)}


def states(prepare: str, *rest: str) -> dict:
    exit_code = "2:0" if prepare == "FAILED" else "0:0"
    out = {"7": {"JobState": prepare, "ExitCode": exit_code}}
    out.update({str(8 + i): {"JobState": s, "ExitCode": "0:0"} for i, s in enumerate(rest)})
    return out


class Replay:
    """scontrol's answers, one pass of follow() per entry; the last one repeats."""

    def __init__(self, *passes: dict):
        self.passes, self.asked = list(passes), 0

    def __call__(self, ids: list[str]) -> dict:
        self.asked += 1
        return self.passes[min(self.asked, len(self.passes)) - 1]


def test_a_pass_that_sees_a_dependent_cancelled_before_its_cause_names_the_cause(tmp_path):
    replay = Replay(
        states("RUNNING", "PENDING", "PENDING", "PENDING", "PENDING", "CANCELLED"),  # CI's pass
        states("COMPLETING", "CANCELLED", "CANCELLED", "CANCELLED", "CANCELLED", "CANCELLED"),
        states("FAILED", "CANCELLED", "CANCELLED", "CANCELLED", "CANCELLED", "CANCELLED"),
    )
    with pytest.raises(UserError) as e:
        chain.follow(tmp_path, CHAIN, 0.0, ask=replay)
    assert str(e.value).startswith(
        "stage prepare: job 7 FAILED (exit 2:0); its log: logs/prepare-7.log; 5 job(s) after it cancelled "
        "(8, 9, 10, 11, 12)"
    ), e.value
    assert replay.asked == 3  # asked again after the cancel, and again while prepare was COMPLETING


def test_a_job_cancelled_by_hand_while_the_ones_before_it_run_is_named_at_once(tmp_path):
    replay = Replay(states("COMPLETED", "COMPLETED", "COMPLETED", "RUNNING", "PENDING", "CANCELLED"))
    with pytest.raises(UserError, match=r"^stage evaluate: job 12 CANCELLED .* 0 job\(s\) after it"):
        chain.follow(tmp_path, CHAIN, 0.0, ask=replay)
    assert replay.asked == 2


def test_a_cause_still_completing_past_the_settle_time_is_named_as_it_shows(tmp_path):
    stuck = states("COMPLETING", "CANCELLED", "CANCELLED", "CANCELLED", "CANCELLED", "CANCELLED")
    stage, _ = chain.cause(ORDER, CHAIN, 0.0, ask=Replay(stuck), settle_s=0.0)
    assert stage == "extract"
