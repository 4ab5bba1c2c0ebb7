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


def test_report_what_you_did_not_choose_on_the_online_accept_length_carries_an_interval_over_prompts():
    """SGLang's per-request counts (tokens, verify passes), pooled per prompt over the repeats of a bench."""
    from pipeline.serving.bench import acceptance

    passes = [  # two repeats of 4 prompts: two at 4 tokens per verify pass, two at 1
        {"completion_tokens": 20, "verify_passes": 10, "by_prompt": [[8, 2], [8, 2], [2, 2], [2, 4]]},
        {"completion_tokens": 20, "verify_passes": 10, "by_prompt": [[8, 2], [8, 2], [2, 2], [2, 4]]},
    ]
    out = acceptance("sglang", passes)
    assert out["accept_length"] == 2.0 and out["prompts"] == 4
    lo, hi = out["accept_length_ci95"]
    assert 0.5 < lo < 2.0 < hi <= 4.0  # between the worst prompt (0.5) and the best (4)
    same = [{**p, "by_prompt": [[4, 2]] * 4, "completion_tokens": 16, "verify_passes": 8} for p in passes]
    assert acceptance("sglang", same)["accept_length_ci95"] == [2.0, 2.0]
