"""Kept answers (pipeline/formats/answers.py, docs/answers.md): a run's regenerated answers written, reused by
another run without asking the server, and every file that must not serve a run refused or left unread, with
a line and a count. The server is tests/openai_test_server.py (the external boundary)."""

import json
import logging
import lzma
import shutil

import openai_test_server as ts
import pytest

from pipeline.data import regenerate as regen
from pipeline.errors import UserError
from pipeline.formats import answers
from pipeline.formats.prepared import load as load_prepared
from pipeline.models import targets
from pipeline.stages import prepare

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
    for n, turns in enumerate([1, 2, 1, 2])
]
TURNS = 6


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
            "prepare.endpoint_concurrency=2",
            *overrides,
            run_dir=tmp_path / name,
        )
        prepare.run(cfg)
        return (*load_prepared(tmp_path / name), cfg)

    return go


def kept_file(tmp_path, name="a"):
    return tmp_path / name / "prepared.partial" / "answers.jsonl.xz"


def rows(ds):
    return [(r["source_id"], r["input_ids"], r["loss_mask"]) for r in ds]


def test_a_runs_answers_serve_another_run_without_asking_and_the_samples_are_the_same(run, tmp_path):
    server = ts.start()
    ds_a, stats_a, _ = run("a", server.url, "prepare.answers=[]")
    asked = len(server.posts)
    ds_b, stats_b, _ = run("b", server.url, f"prepare.answers=[{kept_file(tmp_path)}]")
    server.shutdown()
    assert asked == TURNS and len(server.posts) == TURNS  # run b asked nothing
    assert stats_a["regenerate"]["answers_file"] == str(kept_file(tmp_path))
    assert answers.read(kept_file(tmp_path)).key["max_new_tokens"] == 256
    assert stats_b["regenerate"]["kept_answers"]["used"] == TURNS
    assert rows(ds_a) == rows(ds_b)


def test_a_missing_prompt_is_regenerated_and_counted_and_the_turns_after_it_too(run, tmp_path):
    server = ts.start()
    run("a", server.url, "prepare.answers=[]")
    kept = answers.read(kept_file(tmp_path))
    # drop the answer to conversation 1's first turn: its second turn's prompt holds the new answer
    drop = answers.prompt_key([{"role": "user", "content": "question 0 of conversation 1"}])
    recs = [(p, r) for p, r in kept.by_prompt.items() if p != drop]
    path = tmp_path / "partial.jsonl.xz"
    _write_raw(path, kept.key, recs)
    n = len(server.posts)
    _, stats, _ = run("b", server.url, f"prepare.answers=[{path}]")
    server.shutdown()
    counts = stats["regenerate"]["kept_answers"]
    assert counts["not_kept"] == 1 and counts["used"] == TURNS - 2
    assert len(server.posts) - n == 2  # that turn, then the turn after it (asked from the new answer)


def _write_raw(path, key, recs):
    """A file as answers.write makes it, from (prompt key, record) pairs."""
    import hashlib

    body = "".join(json.dumps({"p": p, "a": r["a"], "n": r["n"]}) + "\n" for p, r in recs).encode()
    head = {
        "kind": answers.KIND,
        "schema": answers.SCHEMA,
        "key": key,
        "produced_by": {},
        "answers": len(recs),
        "sha256": hashlib.sha256(body).hexdigest(),
    }
    path.write_bytes(lzma.compress(json.dumps(head).encode() + b"\n" + body))


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("target", "0123456789abcdef", "another target"),
        ("tokenizer", "0123456789abcdef", "another tokenizer"),
        ("chat_template", "0123456789abcdef", "another chat_template"),
        ("temperature", 0.7, "another temperature"),
    ],
)
def test_a_file_of_another_target_template_or_decoding_is_named_and_not_read(
    run, tmp_path, caplog, field, value, reason
):
    server = ts.start()
    run("a", server.url, "prepare.answers=[]")
    kept = answers.read(kept_file(tmp_path))
    path = tmp_path / "other.jsonl.xz"
    _write_raw(path, kept.key | {field: value}, list(kept.by_prompt.items()))
    _, stats, _ = run("b", server.url, f"prepare.answers=[{path}]")
    server.shutdown()
    assert len(server.posts) == 2 * TURNS  # all regenerated
    counts = stats["regenerate"]["kept_answers"]
    assert counts["used"] == 0 and reason in counts["files"][0]["refused"]
    assert any(str(path) in r.message and reason in r.message for r in caplog.records)


def test_sampling_runs_never_reuse_answers(run, tmp_path):
    server = ts.start()
    run("a", server.url, "prepare.answers=[]")
    _, stats, _ = run("b", server.url, f"prepare.answers=[{kept_file(tmp_path)}]", "prepare.temperature=0.8")
    server.shutdown()
    assert len(server.posts) == 2 * TURNS
    assert "only temperature-0 answers" in stats["regenerate"]["kept_answers"]["files"][0]["refused"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "not_xz", "edited"])
def test_a_damaged_answers_file_is_one_line_naming_it(run, tmp_path, damage):
    server = ts.start()
    run("a", server.url, "prepare.answers=[]")
    path = tmp_path / "damaged.jsonl.xz"
    data = kept_file(tmp_path).read_bytes()
    if damage == "flip":
        data = data[:40] + bytes([data[40] ^ 0xFF]) + data[41:]
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "not_xz":
        data = b"hello"
    else:  # decompresses fine, one answer edited by hand
        text = lzma.decompress(data).decode().replace("reply", "Reply", 1)
        data = lzma.compress(text.encode())
    path.write_bytes(data)
    with pytest.raises(UserError, match=f"{path}: (not a readable|damaged)"):
        run("b", server.url, f"prepare.answers=[{path}]")
    server.shutdown()
    with pytest.raises(UserError, match="does not exist"):
        run("c", "http://127.0.0.1:9", f"prepare.answers=[{tmp_path / 'nope.jsonl.xz'}]")


def test_greedy_answers_serve_smaller_budgets_cut_and_larger_ones_only_if_they_ended(
    make_cfg, tiny_folder, tmp_path
):
    cfg = make_cfg("target=tiny", "prepare.max_new_tokens=8", run_dir=tmp_path / "r")
    tok = targets.load_tokenizer(tiny_folder, cfg.target)
    long_text = " ".join(["hello world"] * 20)
    n_long = len(tok(long_text, add_special_tokens=False)["input_ids"])
    convs = [
        {
            "source_id": "s:0",
            "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}],
        },
        {
            "source_id": "s:1",
            "messages": [{"role": "user", "content": "b"}, {"role": "assistant", "content": ""}],
        },
        {
            "source_id": "s:2",
            "messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": ""}],
        },
    ]
    key = regen.answer_key(cfg, tiny_folder, tok) | {"max_new_tokens": n_long}
    path = tmp_path / "kept.jsonl.xz"
    answers.write(
        path,
        key,
        {},
        [
            ([{"role": "user", "content": "a"}], long_text, n_long),  # cut at its budget
            ([{"role": "user", "content": "b"}], "short", 2),  # ended by itself
            ([{"role": "user", "content": "c"}], "hello", 12),  # ended by itself; does not re-tokenize to 12
        ],
    )

    def reuse(budget):
        c = make_cfg(
            "target=tiny",
            f"prepare.max_new_tokens={budget}",
            f"prepare.answers=[{path}]",
            run_dir=tmp_path / f"r{budget}",
        )
        fresh = json.loads(json.dumps(convs))
        with regen.open_journal(c, tiny_folder, None) as j:
            counts = regen.reuse_answers(c, tiny_folder, tok, fresh, j)
        return counts, [m["messages"][1]["content"] for m in fresh]

    counts, texts = reuse(8)  # smaller budget: the long one cut to its first 8 tokens
    ids = tok(long_text, add_special_tokens=False)["input_ids"]
    assert texts[0] == tok.decode(ids[:8]) and texts[1] == "short"
    assert counts["used"] == 2 and counts["cut_to_budget"] == 1 and counts["retokenizes"] == 1
    counts, texts = reuse(n_long + 10)  # larger budget: only the answer that ended by itself serves
    assert counts["used"] == 2 and counts["longer_budget"] == 1 and texts[1:] == ["short", "hello"]


def test_too_little_disk_keeps_no_file_says_so_and_the_journal_keeps_every_answer(
    run, tmp_path, monkeypatch, caplog
):
    real = shutil.disk_usage
    monkeypatch.setattr(answers.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    server = ts.start()
    ds, stats, _ = run("a", server.url, "prepare.answers=[]")
    server.shutdown()
    assert stats["regenerate"]["answers_file"] is None and not kept_file(tmp_path).exists()
    assert any("answers not kept" in r.message and "MiB free" in r.message for r in caplog.records)
    journal = next((tmp_path / "a" / "prepared.partial").glob("regenerate-*.jsonl"))
    assert len(journal.read_text().splitlines()) == TURNS and len(ds) == len(CONVS)


def test_the_kept_smollm2_answers_are_whole_and_keyed(tmp_path):
    """The file the repository keeps (data/answers/): it reads (sha256 checked) and holds the GPU run's
    21,499 answers at temperature 0."""
    files = regen.kept_answer_files(type("C", (), {"prepare": type("P", (), {"answers": None})})())
    kept = answers.read(next(f for f in files if f.name.startswith("smollm2")))
    assert len(kept.by_prompt) == 21499 and kept.key["temperature"] == 0.0
    assert set(answers.KEY_FIELDS) <= set(kept.key)


def test_no_server_is_started_when_kept_answers_serve_every_turn(run, tmp_path, make_cfg, caplog):
    """prepare.regenerate_server starts nothing when every turn is kept (and asks the server for the rest)."""
    caplog.set_level(logging.INFO)
    server = ts.start()
    run("a", server.url, "prepare.answers=[]")
    server.shutdown()
    d = tmp_path / "d.jsonl"
    cfg = make_cfg(
        "target=tiny",
        "data=messages",
        f"data.path={d}",
        "data.shuffle=false",
        "prepare.regenerate=true",
        "prepare.regenerate_server.engine=command",
        "prepare.regenerate_server.command=[false]",  # a server that cannot start: never started
        f"prepare.answers=[{kept_file(tmp_path)}]",
        run_dir=tmp_path / "b",
    )
    prepare.run(cfg)
    _, stats = load_prepared(tmp_path / "b")
    assert stats["regenerate"]["kept_answers"]["used"] == TURNS
    assert any("no regenerate server started" in r.message for r in caplog.records)
    kept = answers.read(tmp_path / "b" / "prepared.partial" / "answers.jsonl.xz")
    assert kept.produced_by["kept_answers"]["used"] == TURNS


def test_a_refused_file_never_counts_as_serving_so_the_server_still_starts(
    run, tmp_path, make_cfg, tiny_folder
):
    """all_kept decides whether prepare starts its server: a file of another target serves nothing."""
    server = ts.start()
    _, _, cfg = run("a", server.url, "prepare.answers=[]")
    server.shutdown()
    kept = answers.read(kept_file(tmp_path))
    other = tmp_path / "other.jsonl.xz"
    _write_raw(other, kept.key | {"target": "0123456789abcdef"}, list(kept.by_prompt.items()))
    tok = targets.load_tokenizer(tiny_folder, cfg.target)
    convs = [{"source_id": c["id"], "messages": c["messages"]} for c in CONVS]
    for path, serves in ((kept_file(tmp_path), True), (other, False)):
        c = make_cfg("target=tiny", f"prepare.answers=[{path}]", run_dir=tmp_path / "x")
        assert regen.all_kept(c, tiny_folder, tok, json.loads(json.dumps(convs))) is serves
