"""Issue #35, rule 5, "report what you did not choose on": a reported tau carries its prompt count and a 95 %
bootstrap interval over prompts (acceptance/offline.py tau_interval)."""

from pipeline.acceptance.offline import tau_interval


def test_report_what_you_did_not_choose_on_tau_carries_an_interval_over_prompts():
    same = [[2, 2, 2]] * 10  # every prompt accepts 2 per round: tau 3, no spread
    assert tau_interval(same) == [3.0, 3.0]
    mixed = [[0, 0, 0]] * 5 + [[3, 3, 3]] * 5  # half the prompts at tau 1, half at 4: pooled 2.5
    lo, hi = tau_interval(mixed)
    assert 1.0 < lo < 2.5 < hi < 4.0
    assert tau_interval(mixed) == [lo, hi]  # seeded: the same report twice
    wider = tau_interval(mixed[:2] + mixed[5:7])  # fewer prompts, a wider interval
    assert wider[1] - wider[0] > hi - lo
    assert tau_interval([[1, 1]]) == [2.0, 2.0]  # one prompt: no interval to draw
