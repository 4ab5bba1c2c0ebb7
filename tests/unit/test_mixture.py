"""data=mix (pipeline/data/mixture.py): sources deduplicated across the mixture, per-source limits and
weights,
per-source held-out chosen by a hash of the text, and train validating on exactly the held-out samples."""

import json
from types import SimpleNamespace

import pytest

from pipeline.data.features_dataset import split
from pipeline.data.mixture import load_conversations
from pipeline.errors import UserError
from pipeline.formats import prepared


def chat(user, cid):
    return {
        "id": cid,
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "ok " + cid}],
    }


def write(path, convs):
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    return str(path)


@pytest.fixture
def files(tmp_path):
    # a: 10 questions, one repeated with other case/punctuation/spacing; b: 6, two of them already in a
    a = [chat(f"question number {i}?", f"a{i}") for i in range(10)] + [chat("  QUESTION number 3!!", "a-dup")]
    b = [chat(f"other thing {i}", f"b{i}") for i in range(4)] + [
        chat("Question, number 1", "b-dup1"),
        chat("question number 7", "b-dup7"),
    ]
    return write(tmp_path / "a.jsonl", a), write(tmp_path / "b.jsonl", b)


def source(path, name, **kw):
    return SimpleNamespace(
        **{
            "format": "messages",
            "name": name,
            "path": path,
            "limit": None,
            "weight": None,
            "heldout": 0,
            **kw,
        }
    )


def mix(*sources, limit=None, seed=0, shuffle=True):
    return SimpleNamespace(
        name="mix",
        format="mix",
        path=None,
        split="train",
        limit=limit,
        seed=seed,
        shuffle=shuffle,
        on_error="skip",
        sources=list(sources),
    )


def by_source(convs, heldout=False):
    out = {}
    for c in convs:
        if c["heldout"] == heldout:
            out.setdefault(c["source"], []).append(c["source_id"])
    return out


def test_duplicates_across_the_mixture_are_dropped_on_the_normalised_first_user_turn_and_counted_per_source(
    files,
):
    convs, problems = load_conversations(mix(source(files[0], "a"), source(files[1], "b")))
    assert len(convs) == 14 and {k: len(v) for k, v in by_source(convs).items()} == {"a": 10, "b": 4}
    assert problems.as_dict() == {"a: duplicate first user turn": 1, "b: duplicate first user turn": 2}
    assert problems.where["b: duplicate first user turn"] == ["b-dup1", "b-dup7"]
    report = problems.summary["sources"]
    assert [(r["usable"], r["duplicates"], r["train"]) for r in report.values()] == [(11, 1, 10), (6, 2, 4)]
    assert all(c["source_id"].startswith(c["source"] + ":") for c in convs)


def test_source_limits_then_data_limit_count_exactly(files):
    convs, problems = load_conversations(mix(source(files[0], "a", limit=3), source(files[1], "b", limit=2)))
    assert {k: len(v) for k, v in by_source(convs).items()} == {"a": 3, "b": 2}
    convs, problems = load_conversations(mix(source(files[0], "a", limit=3), source(files[1], "b"), limit=5))
    assert len(convs) == 5 and problems.summary["train"] == 5
    assert sum(r["train"] for r in problems.summary["sources"].values()) == 5


def test_weights_share_data_limit(files):
    convs, problems = load_conversations(
        mix(source(files[0], "a", weight=3.0), source(files[1], "b", weight=1.0), limit=8)
    )
    assert {k: len(v) for k, v in by_source(convs).items()} == {"a": 6, "b": 2}
    convs, problems = load_conversations(
        mix(source(files[0], "a", weight=1.0), source(files[1], "b", weight=3.0), limit=8)
    )
    assert {k: len(v) for k, v in by_source(convs).items()} == {"a": 2, "b": 4}  # b has 4 of its share of 6
    assert problems.summary["sources"]["b"]["asked"] == 6


def test_heldout_comes_first_and_is_the_same_for_any_limit_seed_or_order(files):
    def held(*sources, **kw):
        convs, problems = load_conversations(mix(*sources, **kw))
        n = problems.summary["heldout"]
        assert all(c["heldout"] for c in convs[:n]) and not any(c["heldout"] for c in convs[n:])
        return by_source(convs, heldout=True), by_source(convs)

    base, train = held(source(files[0], "a", heldout=3), source(files[1], "b", heldout=2))
    assert {k: len(v) for k, v in base.items()} == {"a": 3, "b": 2}
    assert not set(base["a"]) & set(train["a"]) and len(train["a"]) == 10 - 3
    for kw in (dict(limit=2), dict(seed=7), dict(shuffle=False)):
        assert (
            held(source(files[0], "a", heldout=3, limit=1), source(files[1], "b", heldout=2), **kw)[0] == base
        )
    # the sources' held-out conversations are interleaved (by hash), not one source's block then the next's:
    # the tau probe and evaluate each take the first of their half of them
    convs, problems = load_conversations(
        mix(source(files[0], "a", heldout=5), source(files[1], "b", heldout=5))
    )
    order = [c["source"] for c in convs[: problems.summary["heldout"]]]
    assert order.count("a") == 5 and order.count("b") >= 3
    assert order != sorted(order) and order != sorted(order, reverse=True)
    # a's held-out set grows by one, the three before stay
    more, _ = held(source(files[0], "a", heldout=4), source(files[1], "b", heldout=2))
    assert set(base["a"]) < set(more["a"])


def test_mix_config_problems_are_reported_together(files):
    with pytest.raises(UserError) as e:
        load_conversations(
            mix(
                source(files[0], "a", weight=1.0, heldout=-1),
                source(files[1], "a"),
                SimpleNamespace(format="mix", name=None, path=None, limit=0, weight=None, heldout=0),
            )
        )
    msg = str(e.value)
    for part in (
        "data.sources[a].heldout=-1",
        "format=mix cannot be nested",
        "data.sources[mix].limit=0",
        "a named twice",
        "set weight on every source or on none",
        "weights, which share data.limit",
    ):
        assert part in msg, part


def test_prepare_marks_the_heldout_and_train_validates_on_exactly_them(
    make_cfg, tmp_path, files, tiny_folder
):
    from pipeline.stages import prepare

    cfg = make_cfg(
        "target=tiny",
        "data=mix",
        f"data.sources=[{{format: messages, name: a, path: {files[0]}, heldout: 3}}, "
        f"{{format: messages, name: b, path: {files[1]}, heldout: 2, limit: 1}}]",
        run_dir=tmp_path / "run",
    )
    prepare.run(cfg)
    ds, stats = prepared.load(tmp_path / "run")
    ids = prepared.heldout_samples(tmp_path / "run")
    assert ids == [0, 1, 2, 3, 4] and len(ds) == 5 + 7 + 1
    assert stats["mix"]["sources"]["b"]["duplicates"] == 2 and stats["leaks"]["exact"] == 0
    held, _ = load_conversations(mix(source(files[0], "a", heldout=3), source(files[1], "b", heldout=2)))
    assert [ds[i]["source_id"] for i in ids] == [c["source_id"] for c in held[:5]]
    train_idx, val_idx = split(len(ds), 0.5, 0, ids)
    assert val_idx.tolist() == ids and train_idx.tolist() == list(range(5, 13))


def test_prepare_drops_a_planted_mt_bench_prompt_under_on_leak_drop(make_cfg, tmp_path, files, tiny_folder):
    from pipeline.stages import prepare

    leak = write(
        tmp_path / "leak.jsonl", [chat("Prove the Pythagorean theorem.", "p"), chat("hi there", "h")]
    )
    sources = (
        f"data.sources=[{{format: messages, name: a, path: {files[0]}}}, "
        f"{{format: messages, name: l, path: {leak}}}]"
    )
    with pytest.raises(
        UserError, match=r"^1 training conversations hold .*l:p ~ mt_bench:99 turn 2 \(exact\)"
    ):
        prepare.run(make_cfg("target=tiny", "data=mix", sources, run_dir=tmp_path / "fail"))
    prepare.run(make_cfg("target=tiny", "data=mix", sources, "data.on_leak=drop", run_dir=tmp_path / "drop"))
    ds, stats = prepared.load(tmp_path / "drop")
    assert len(ds) == 11 and "l:p" not in ds["source_id"]
    assert (stats["leaks"]["dropped"], stats["leaks"]["per_source"]) == (1, {"l": {"exact": 1}})


def test_train_split_without_heldout_is_the_seeded_permutation():
    assert [a.tolist() for a in split(10, 0.2, 0, [])] == [a.tolist() for a in split(10, 0.2, 0)]
    train_idx, val_idx = split(10, 0.2, 0, [8, 3, 12])  # 12: past the store (extract.limit)
    assert val_idx.tolist() == [3, 8] and 3 not in train_idx and len(train_idx) == 8
