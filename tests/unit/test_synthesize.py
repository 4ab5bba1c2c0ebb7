"""Magpie-style prompts: the user prefix from the template, each filter dropping exactly what it should, and
prepare.synthesize end to end through the test server's /v1/completions (tests/openai_test_server.py)."""

import json

import openai_test_server as ts
import pytest

from pipeline.data.synthesize import REASONS, filter_prompts, user_prefix
from pipeline.formats.prepared import load as load_prepared
from pipeline.stages import prepare

GOOD = "How do I keep basil plants alive on a windowsill in winter?"


def drops_of(texts, existing=(), special=("<|im_end|>",)):
    kept, drops = filter_prompts(texts, existing, min_chars=16, max_chars=200, special_tokens=special)
    assert set(drops) == set(REASONS)
    return [t for _, t in kept], {r: n for r, n in drops.items() if n}


def test_a_plain_question_is_kept_stripped():
    assert drops_of([f"  {GOOD}\n"]) == ([GOOD], {})


def test_length_bounds_drop_short_and_long_texts():
    assert drops_of(["", "Why?", "x" * 10 + " " + GOOD * 4, GOOD]) == (
        [GOOD],
        {"too short": 2, "too long": 1},
    )


@pytest.mark.parametrize(
    "text",
    [
        "What is this?<|im_end|>",
        "user: tell me a joke about cats please",
        "Tell me a joke.\nassistant: Why did the cat sit on the computer?",
        "<|im_start|>assistant hello there how are you",
        "[INST] write a haiku about rain",
    ],
)
def test_role_tokens_leaking_drop_the_text(text):
    assert drops_of([text, GOOD]) == ([GOOD], {"role token leak": 1})


@pytest.mark.parametrize(
    "text",
    [
        "I'm sorry, but I can't help with that request.",
        "As an AI, I do not have opinions.",
        "Sure! Here is a poem about the ocean waves.",
        "Certainly. The answer is 42 for you.",
        "Here's a summary of the article you sent.",
    ],
)
def test_assistant_like_replies_are_dropped(text):
    assert drops_of([text, GOOD]) == ([GOOD], {"assistant-like reply": 1})


def test_garbage_repeats_are_dropped():
    assert drops_of(["a" * 30, "go go go go go go go go go go go go", GOOD]) == ([GOOD], {"garbage": 2})


@pytest.mark.parametrize(
    "text",
    [
        "Wie kann ich im Winter Basilikum auf der Fensterbank halten?",
        "Как сохранить базилик зимой на подоконнике?",
        "1234 5678 9012 3456 !!!! ????",
        "这是一个关于植物的问题，请告诉我怎么做",
    ],
)
def test_non_english_text_is_dropped(text):
    assert drops_of([text, GOOD]) == ([GOOD], {"not English": 1})


def test_duplicates_are_dropped_after_normalising_and_against_existing_first_user_turns():
    texts = [
        GOOD,
        GOOD.upper() + "  ",
        "Explain how tides work, in simple words.",
        "explain how TIDES work in simple words",
    ]
    kept, drops = drops_of(texts, existing=["Explain how tides work in simple words!"])
    assert kept == [GOOD] and drops == {"duplicate": 3}


def test_each_text_is_counted_once_by_the_first_filter_it_meets():
    texts = [
        GOOD,
        "Sorry<|im_end|>",
        "I'm sorry <|im_end|> I can't",
        "I'm sorry, I cannot do that for you.",
        GOOD,
    ]
    kept, drops = drops_of(texts)  # short and leaking; leaking and a refusal; a refusal; a duplicate
    assert kept == [GOOD] and drops == {
        "too short": 1,
        "role token leak": 1,
        "assistant-like reply": 1,
        "duplicate": 1,
    }
    assert sum(drops.values()) + len(kept) == len(texts)


def test_the_user_prefix_is_the_template_cut_before_the_user_text(tiny_folder, make_cfg):
    from pipeline.models import targets

    tok = targets.load_tokenizer(tiny_folder, make_cfg("target=tiny").target)
    assert user_prefix(tok) == "<|im_start|>user\n"
    assert user_prefix(tok, "Be brief.") == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"


def test_prepare_synthesize_adds_the_kept_prompts_answered_by_the_target(make_cfg, tmp_path, tiny_folder):
    (tmp_path / "d.jsonl").write_text(
        json.dumps(
            {
                "id": "c0",
                "messages": [
                    {"role": "user", "content": "Explain how a rainbow forms after the rain."},
                    {"role": "assistant", "content": "old"},
                ],
            }
        )
        + "\n"
    )
    server = ts.start()
    cfg = make_cfg(
        "target=tiny",
        "data=messages",
        f"data.path={tmp_path / 'd.jsonl'}",
        "prepare.regenerate=true",
        f"prepare.regenerate_endpoint={server.url}",
        "prepare.synthesize=6",
        run_dir=tmp_path / "r",
    )
    prepare.run(cfg)
    prepare.run(cfg.copy())  # rebuilt (the journal has every text): no request asked again
    server.shutdown()
    ds, stats = load_prepared(tmp_path / "r")
    completions = [p for p in server.posts if "prompt" in p]
    assert len(completions) == 6 and {p["seed"] for p in completions} == set(range(6))
    assert all(p["prompt"] == "<|im_start|>user\n" and p["temperature"] == 1.0 for p in completions)
    s = stats["synthesize"]
    # SYNTH_TEXTS by seed: 0 kept, 1 a refusal, 2 the data's own first user turn, 3 a copy of 0, 4 too short,
    # 5 kept
    assert s["kept"] == 2 and {r: n for r, n in s["dropped"].items() if n} == {
        "assistant-like reply": 1,
        "duplicate": 2,
        "too short": 1,
    }
    assert sorted(ds["source_id"]) == ["c0", "synth:0", "synth:5"]
    chats = [p["messages"] for p in server.posts if "messages" in p]
    assert {m[0]["content"] for m in chats} == {ts.SYNTH_TEXTS[0], ts.SYNTH_TEXTS[5], ts.SYNTH_TEXTS[2]}
    assert len(server.posts) == 6 + 3


def test_a_synthesized_prompt_that_recites_an_eval_prompt_is_checked_like_the_data(
    make_cfg, tmp_path, tiny_folder, monkeypatch
):
    """The target can write an MT-bench question as its 'own' prompt: the leak check runs on synthesized
    prompts
    too (data.on_leak=drop here: dropped and counted in synthesize's own leak report)."""
    from pipeline.data import leaks

    question = leaks.eval_prompts()[0][1]
    monkeypatch.setattr(
        ts, "SYNTH_TEXTS", [question, "Can you write a short poem about the sea and the wind?"]
    )
    (tmp_path / "d.jsonl").write_text(
        json.dumps(
            {
                "id": "c0",
                "messages": [
                    {"role": "user", "content": "Explain how a rainbow forms after the rain."},
                    {"role": "assistant", "content": "old"},
                ],
            }
        )
        + "\n"
    )
    server = ts.start()
    cfg = make_cfg(
        "target=tiny",
        "data=messages",
        f"data.path={tmp_path / 'd.jsonl'}",
        "prepare.regenerate=true",
        f"prepare.regenerate_endpoint={server.url}",
        "prepare.synthesize=2",
        "data.on_leak=drop",
        run_dir=tmp_path / "r",
    )
    prepare.run(cfg)
    server.shutdown()
    ds, stats = load_prepared(tmp_path / "r")
    assert stats["synthesize"]["leaks"]["dropped"] == 1 and stats["synthesize"]["kept"] == 2
    assert sorted(ds["source_id"]) == ["c0", "synth:1"]
