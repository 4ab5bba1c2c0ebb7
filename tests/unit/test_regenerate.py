"""Regeneration through a real OpenAI-compatible HTTP server (tests/openai_test_server.py, the external
boundary):
per-conversation turns, the journal a rerun resumes from, retries, failure counts, stats."""

import json

import openai_test_server as ts
import pytest

from pipeline.data.journal import Journal
from pipeline.errors import UserError
from pipeline.formats.prepared import load as load_prepared
from pipeline.runner import preflight
from pipeline.stages import prepare

# 6 conversations, 1 to 3 assistant turns each: 12 turns, every reply asked from the regenerated prefix before
# it
CONVS = [
    {
        "id": f"c{n}",
        "messages": [
            m
            for t in range(turns)
            for m in (
                {"role": "user", "content": f"question {t} of conversation {n}"},
                {"role": "assistant", "content": "old"},
            )
        ],
    }
    for n, turns in enumerate([1, 3, 2, 1, 3, 2])
]
TURNS = 12


@pytest.fixture
def run(make_cfg, tmp_path, tiny_folder):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CONVS))

    def go(name, url, *overrides):
        cfg = make_cfg(
            "target=tiny",
            "data=messages",
            f"data.path={tmp_path / 'd.jsonl'}",
            "data.shuffle=false",
            "prepare.regenerate=true",
            f"prepare.regenerate_endpoint={url}",
            "prepare.endpoint_backoff_s=0.01",
            "prepare.endpoint_retries=2",
            "prepare.endpoint_concurrency=3",
            *overrides,
            run_dir=tmp_path / name,
        )
        prepare.run(cfg)
        return load_prepared(tmp_path / name)

    return go


def rows(ds):
    return [(r["source_id"], r["input_ids"], r["loss_mask"]) for r in ds]


def prefixes(posts):
    return [json.dumps(p["messages"], sort_keys=True) for p in posts]


def journal_lines(run_dir):
    return [
        json.loads(line)
        for f in (run_dir / "prepared.partial").glob("regenerate-*.jsonl")
        for line in f.read_text().splitlines()
    ]


def test_each_turn_is_asked_from_the_regenerated_turns_before_it(run):
    server = ts.start()
    ds, stats = run("a", server.url)
    server.shutdown()
    assert len(server.posts) == TURNS and stats["regenerate"]["turns_replaced"] == TURNS
    for (
        p
    ) in server.posts:  # every assistant turn in a prefix is the server's own answer to what came before it
        msgs = p["messages"]
        assert all(
            m["content"] == ts.chat_reply(msgs[:i]) for i, m in enumerate(msgs) if m["role"] == "assistant"
        )
    r = stats["regenerate"]
    assert (
        r["requests"] == TURNS and r["retries"] == 0 and r["failures"] == {} and r["turns_from_journal"] == 0
    )
    assert r["completion_tokens"] == sum(len(ts.chat_reply(p["messages"]).split()) for p in server.posts)
    assert r["tokens_per_s"] > 0 and r["wall_s"] > 0


def test_a_server_dying_mid_run_is_one_line_and_the_rerun_asks_only_for_what_was_not_committed(run, tmp_path):
    ref = ts.start()
    ref_ds, _ = run("ref", ref.url)
    ref.shutdown()
    dying = ts.start(die_after=5)
    with pytest.raises(
        UserError,
        match=r"not finished .*is the server running.*5 replies are committed.*rerun the "
        r"same command to resume",
    ) as e:
        run("b", dying.url)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "b" / "prepared" / "stats.json").exists()
    assert len(journal_lines(tmp_path / "b")) == 5  # exactly the answered ones, committed
    back = ts.start(port=dying.server_port)  # the server comes back where it was
    ds, stats = run("b", back.url)
    back.shutdown()
    first, second = prefixes(dying.posts[:5]), prefixes(back.posts)
    assert not set(first) & set(second)  # no committed turn asked again
    assert sorted(first + second) == sorted(
        prefixes(ref.posts)
    )  # no gap: every turn asked exactly once overall
    assert rows(ds) == rows(ref_ds) and stats["regenerate"]["turns_from_journal"] == 5
    assert stats["regenerate"]["requests"] == TURNS - 5


def test_500s_then_recovery_are_retried_and_counted(run):
    server = ts.start(fail_first=2)
    _, stats = run("a", server.url, "prepare.endpoint_concurrency=1")
    server.shutdown()
    r = stats["regenerate"]
    assert (
        r["failures"] == {}
        and r["retries"] == 2
        and r["requests"] == TURNS + 2
        and r["turns_replaced"] == TURNS
    )


@pytest.mark.parametrize("how, reason", [("500", "HTTP 5xx"), ("empty", "empty reply")])
def test_a_turn_that_keeps_failing_is_counted_in_one_line_and_committed_turns_stay(
    run, tmp_path, how, reason
):
    server = ts.start(
        bad={"question 1 of": how}
    )  # the second turn of c1, c2, c4, c5; their third never asked
    with pytest.raises(
        UserError,
        match=rf"4 of 6 conversations not finished after 2 retries per request \(4 {reason}\); "
        r"6 replies are committed",
    ) as e:
        run("a", server.url)
    server.shutdown()
    assert "\n" not in str(e.value) and "is the server running" not in str(e.value)
    assert len(server.posts) == 6 + 4 * 3  # the 6 first turns, answered; 4 failing turns x 3 attempts
    assert len(journal_lines(tmp_path / "a")) == 6


def test_on_failed_request_drop_drops_those_conversations_and_counts_them_and_the_empty_replies(run):
    server = ts.start(bad={"question 1 of": "empty"})
    ds, stats = run("a", server.url, "prepare.on_failed_request=drop")
    server.shutdown()
    r = stats["regenerate"]
    assert sorted(ds["source_id"]) == ["c0", "c3"] and r["dropped_conversations"] == 4
    assert r["failures"] == {"empty reply": 4} and r["empty_replies"] == 12


def test_a_torn_last_journal_line_is_cut_off_and_the_rerun_equals_an_uninterrupted_run(run, tmp_path):
    server = ts.start()
    ref_ds, _ = run("ref", server.url)
    journal = next((tmp_path / "ref" / "prepared.partial").glob("regenerate-*.jsonl"))
    lines = journal.read_bytes().splitlines(keepends=True)
    torn = tmp_path / "b" / "prepared.partial" / journal.name
    torn.parent.mkdir(parents=True)
    torn.write_bytes(b"".join(lines[:7]) + lines[7][: len(lines[7]) // 2])  # killed while writing line 8
    server.posts.clear()
    ds, stats = run("b", server.url)
    server.shutdown()
    assert len(server.posts) == TURNS - 7 and stats["regenerate"]["turns_from_journal"] == 7
    assert rows(ds) == rows(ref_ds)
    assert [json.loads(x) for x in torn.read_text().splitlines()]  # every line whole again


def test_a_journal_written_with_other_generation_settings_is_not_reused(run):
    server = ts.start()
    run("a", server.url)
    _, stats = run("a", server.url, "prepare.max_new_tokens=17")
    server.shutdown()
    assert len(server.posts) == 2 * TURNS and stats["regenerate"]["turns_from_journal"] == 0
    assert all(p["max_tokens"] == 17 for p in server.posts[TURNS:])


def test_replies_without_usage_are_counted_with_the_tokenizer(run, tiny_folder, make_cfg):
    from pipeline.models import targets

    server = ts.start(no_usage=True)
    _, stats = run("a", server.url)
    server.shutdown()
    tok = targets.load_tokenizer(tiny_folder, make_cfg("target=tiny").target)
    assert stats["regenerate"]["completion_tokens"] == sum(
        len(tok(ts.chat_reply(p["messages"]), add_special_tokens=False)["input_ids"]) for p in server.posts
    )


def test_an_endpoint_down_at_the_start_is_one_line_naming_it(run):
    server = ts.start()
    url = server.url
    server.shutdown()
    server.server_close()
    with pytest.raises(
        UserError, match=rf"regenerate endpoint {url}: not reachable .*is the server running\?$"
    ):
        run("a", url)


def test_the_journal_cuts_a_garbled_last_line_and_refuses_a_damaged_earlier_one(tmp_path):
    with Journal(tmp_path, "f") as j:
        j.commit("k1", "one", 1)
        j.commit("k2", "two", 1)
    path = tmp_path / "regenerate-f.jsonl"
    path.write_bytes(path.read_bytes() + b'{"key": "k3", "te\n')
    j = Journal(tmp_path, "f")
    j.close()
    assert j.torn and set(j.done) == {"k1", "k2"} and path.read_text().count("\n") == 2
    path.write_bytes(b"garbage\n" + path.read_bytes())
    with pytest.raises(UserError, match="line 1 is damaged"):
        Journal(tmp_path, "f")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["prepare.synthesize=4"], "prepare.synthesize needs prepare.regenerate=true"),
        (
            [
                "prepare.regenerate=true",
                "prepare.regenerate_server.engine=sglang",
                "prepare.regenerate_endpoint=http://x:1",
            ],
            "regenerate_server.engine=sglang and prepare.regenerate_endpoint are both set",
        ),
        (
            ["prepare.regenerate_server.engine=vllm"],
            "regenerate_server.engine=vllm but prepare.regenerate=false",
        ),
        (
            ["prepare.regenerate=true", "prepare.endpoint_concurrency=0"],
            r"prepare.endpoint_concurrency=0 must be >= 1",
        ),
    ],
)
def test_check_refuses_generation_settings_that_cannot_work(make_cfg, tmp_path, overrides, message):
    """Through the runner's preflight: the range is config_limits', the rest prepare's own check."""
    with pytest.raises(UserError, match=message):
        preflight(make_cfg("target=tiny", *overrides, run_dir=tmp_path), ["prepare"])


def test_how_replies_are_fetched_is_not_in_prepares_fingerprint_what_shapes_them_is(
    make_cfg, tmp_path, tiny_folder
):
    base = ["target=tiny", "prepare.regenerate=true"]
    fp = prepare.fingerprint(make_cfg(*base, run_dir=tmp_path))
    for same in (
        "prepare.regenerate_endpoint=http://127.0.0.1:9",
        "prepare.endpoint_concurrency=3",
        "prepare.endpoint_retries=1",
        "prepare.regenerate_server.port=31000",
    ):
        assert prepare.fingerprint(make_cfg(*base, same, run_dir=tmp_path)) == fp, same
    for other in ("prepare.max_new_tokens=7", "prepare.on_failed_request=drop", "prepare.synthesize=3"):
        assert prepare.fingerprint(make_cfg(*base, other, run_dir=tmp_path)) != fp, other


def test_a_prompt_of_max_len_tokens_or_more_is_never_sent_and_its_conversation_is_cut_with_a_count(
    run, tiny_folder
):
    """A turn whose prompt holds >= prepare.max_len tokens would never be trained on (samples are cut there),
    and a server refuses one longer than its context (HTTP 400 on the H200): the conversation is cut before
    it, or dropped when nothing is left, and counted; the server never sees such a prompt, also on a later
    turn whose prompt grew
    long only through the regenerated answers before it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_folder)
    server = ts.start()
    ds, stats = run("long", server.url, "prepare.max_len=45")
    server.shutdown()
    lengths = [
        len(
            tok(
                tok.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            )["input_ids"]
        )
        for p in server.posts
    ]
    r = stats["regenerate"]
    assert lengths and max(lengths) < 45
    assert r["cut_at_a_long_prompt"] > 0  # later turns that grew long through regenerated answers
    assert r["failures"] == {} and r["requests"] == len(server.posts) < TURNS
    assert len(ds) == len(CONVS) - r["long_prompts"]["dropped"]
