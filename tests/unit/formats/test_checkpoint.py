"""Training checkpoints (pipeline/formats/checkpoint.py): written whole or not at all, found by the step
recorded inside them, the newest kept, everything cleared on a fresh start."""

import hashlib
import json

from pipeline.formats import checkpoint as ckpt


def save(root, step, keep_last=0, **extra):
    tmp = ckpt.begin(root, step)
    (tmp / "weights.bin").write_bytes(b"w%d" % step)  # what accelerate's save_state would put there
    return ckpt.finish(root, tmp, {"optimizer_step": step, "epoch": 0, **extra}, keep_last)


def test_a_finished_checkpoint_is_step_dir_with_its_state_and_no_tmp(tmp_path):
    final = save(tmp_path, 7, batches_done_in_epoch=3)
    assert final == tmp_path / "step_000007"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000007"]
    state = json.loads((final / ckpt.STATE).read_text())
    assert {k: v for k, v in state.items() if k != "state_sha256"} == {
        "schema_version": ckpt.SCHEMA_VERSION,
        "optimizer_step": 7,
        "epoch": 0,
        "batches_done_in_epoch": 3,
        "checksums": {"weights.bin": {"bytes": 2, "sha256": hashlib.sha256(b"w7").hexdigest()}},
    }
    assert (final / "weights.bin").read_bytes() == b"w7"
    assert ckpt.damage(final, state) is None


def test_checksummed_damage_names_a_changed_cut_or_missing_file_and_an_edited_state(tmp_path):
    """Issue #35 rule 3: what finish recorded is what damage checks (resume falls back on any of these)."""
    final = save(tmp_path, 7)
    state = json.loads((final / ckpt.STATE).read_text())
    (final / "weights.bin").write_bytes(b"w8")
    changed = "weights.bin's sha256 differs from the one recorded when it was written"
    assert ckpt.damage(final, state) == changed
    (final / "weights.bin").write_bytes(b"w")
    assert ckpt.damage(final, state) == "weights.bin is cut short (1 bytes, 2 when written)"
    (final / "weights.bin").unlink()
    assert ckpt.damage(final, state) == "weights.bin is missing"
    assert ckpt.damage(final, {**state, "epoch": 1}).startswith(f"{ckpt.STATE} differs")
    (final / ckpt.STATE).write_text('{"optimizer_st')  # cut short: found by its name, never resumed
    assert ckpt.candidates(tmp_path) == [(final, None)] and ckpt.complete(tmp_path) == []
    assert ckpt.damage(final, None) == f"{ckpt.STATE} cannot be read"


def test_latest_is_the_highest_recorded_step_not_the_newest_or_the_largest_name(tmp_path):
    for step in (2, 10, 4):
        save(tmp_path, step)
    assert ckpt.latest(tmp_path)[0] == tmp_path / "step_000010"
    assert [s["optimizer_step"] for _, s in ckpt.complete(tmp_path)] == [2, 4, 10]
    # a directory name says nothing: the state inside it does
    (tmp_path / "step_000010").rename(tmp_path / "step_000001")
    path, state = ckpt.latest(tmp_path)
    assert (path.name, state["optimizer_step"]) == ("step_000001", 10)


def test_half_written_foreign_and_other_schema_checkpoints_are_never_picked(tmp_path):
    save(tmp_path, 3)
    ckpt.begin(tmp_path, 9)  # interrupted while saving: a .tmp without state
    (tmp_path / "step_000008").mkdir()  # no train_state.json
    (tmp_path / "step_000006").mkdir()
    (tmp_path / "step_000006" / ckpt.STATE).write_text(json.dumps({"schema_version": 0, "optimizer_step": 6}))
    tmp = ckpt.begin(tmp_path, 12)  # a complete-looking state inside a .tmp is still unfinished
    (tmp / ckpt.STATE).write_text(json.dumps({"schema_version": ckpt.SCHEMA_VERSION, "optimizer_step": 12}))
    assert [p.name for p, _ in ckpt.complete(tmp_path)] == ["step_000003"]
    assert ckpt.latest(tmp_path)[1]["optimizer_step"] == 3


def test_latest_of_an_empty_or_missing_root_is_none(tmp_path):
    assert ckpt.latest(tmp_path) is None
    assert ckpt.latest(tmp_path / "absent") is None


def test_only_the_newest_keep_last_survive(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000004"]


def test_keep_last_zero_keeps_every_checkpoint(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, keep_last=0)
    assert len(ckpt.complete(tmp_path)) == 3


def test_saving_a_step_again_replaces_it_and_begin_discards_a_stale_tmp(tmp_path):
    save(tmp_path, 5)
    tmp = ckpt.begin(tmp_path, 5)
    (tmp / "stale").write_text("x")
    tmp = ckpt.begin(tmp_path, 5)  # begins empty again
    assert list(tmp.iterdir()) == []
    (tmp / "weights.bin").write_bytes(b"new")
    ckpt.finish(tmp_path, tmp, {"optimizer_step": 5, "epoch": 1}, keep_last=2)
    assert (tmp_path / "step_000005" / "weights.bin").read_bytes() == b"new"
    assert ckpt.latest(tmp_path)[1]["epoch"] == 1


def test_a_fresh_start_sets_every_checkpoint_aside_and_deletes_them_only_at_its_first_own_checkpoint(
    tmp_path,
):
    save(tmp_path, 1)
    save(tmp_path, 2)
    ckpt.begin(tmp_path, 3)
    (tmp_path / "final").mkdir()
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "plots").mkdir()
    assert ckpt.set_aside(tmp_path) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.REPLACED, "metrics.jsonl", "plots"]
    assert ckpt.latest(tmp_path) is None  # resume never looks there
    assert sorted(p.name for p in (tmp_path / ckpt.REPLACED / "000").iterdir()) == [
        "final",
        "step_000001",
        "step_000002",
        "step_000003.tmp",
    ]
    assert ckpt.set_aside(tmp_path) == 0
    save(tmp_path, 7)  # the new run's first complete checkpoint: now the old ones go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "plots", "step_000007"]
