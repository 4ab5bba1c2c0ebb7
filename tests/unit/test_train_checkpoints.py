"""train's checkpoint handling with a stand-in accelerator: save through a .tmp folder, resume from the newest
checkpoint of the same upstream (refusing one of other inputs), clear everything on a fresh start."""

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from pipeline.config import TrainConfig
from pipeline.config_choices import Resume
from pipeline.errors import UserError
from pipeline.formats import checkpoint as ckpt
from pipeline.training import checkpoints

UPSTREAM = {"features_manifest_hash": "f1", "train_config_hash": "t1"}


class Accelerator:
    """What train's checkpoint code asks of accelerate's Accelerator, recorded."""

    is_main_process = True
    num_processes = 1

    def __init__(self):
        self.loaded, self.saved_into = [], []

    def wait_for_everyone(self):
        pass

    def save_state(self, path):
        self.saved_into.append(path)
        with open(f"{path}/model.safetensors", "w") as f:
            f.write("weights")

    def load_state(self, path):
        self.loaded.append(path)


def session(root, upstream=UPSTREAM):
    return SimpleNamespace(accelerator=Accelerator(), root=root, upstream=dict(upstream), sharded=False)


def cfg(resume=Resume.auto, seed=0):
    c = OmegaConf.structured({"seed": seed, "train": TrainConfig()})
    c.train.resume = resume
    return c


def save(s, step, epoch=0, done=0, seed=0, upstream=UPSTREAM, keep_last=3):
    checkpoints.save(
        s,
        {
            "optimizer_step": step,
            "epoch": epoch,
            "packs_done_in_epoch": done,
            "seed": seed,
            "upstream": dict(upstream),
        },
        keep_last,
    )


def test_save_writes_the_accelerator_state_into_tmp_then_publishes_the_step(tmp_path):
    s = session(tmp_path)
    save(s, 4, epoch=1, done=6)
    assert s.accelerator.saved_into == [str(tmp_path / "step_000004.tmp")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004"]
    path, state = ckpt.latest(tmp_path)
    assert (path / "model.safetensors").read_text() == "weights"
    assert (state["optimizer_step"], state["epoch"], state["packs_done_in_epoch"]) == (4, 1, 6)


def test_save_keeps_the_newest_keep_last(tmp_path):
    s = session(tmp_path)
    for step in (2, 4, 6):
        save(s, step, keep_last=2)
    assert [p.name for p, _ in ckpt.complete(tmp_path)] == ["step_000004", "step_000006"]


def test_resume_auto_continues_from_the_newest_checkpoint_at_its_recorded_position(tmp_path):
    s = session(tmp_path)
    save(s, 2, epoch=0, done=2)
    save(s, 5, epoch=1, done=3)
    p = checkpoints.resume_or_clear(cfg(), s)
    assert (p.step, p.epoch, p.packs_done) == (5, 1, 3)
    assert s.accelerator.loaded == [str(tmp_path / "step_000005")]


def test_resume_refuses_a_checkpoint_of_other_inputs(tmp_path):
    s = session(tmp_path)
    save(s, 3, upstream={**UPSTREAM, "features_manifest_hash": "other"})
    with pytest.raises(UserError, match="trained on other inputs.*train.resume=never"):
        checkpoints.resume_or_clear(cfg(), s)
    assert (tmp_path / "step_000003").is_dir()  # refused, not deleted


def test_resume_refuses_a_checkpoint_of_another_seed(tmp_path):
    s = session(tmp_path)
    save(s, 3, seed=1)
    with pytest.raises(UserError, match="trained on other inputs"):
        checkpoints.resume_or_clear(cfg(seed=0), s)


def test_resume_never_starts_at_zero_and_sets_every_earlier_checkpoint_and_final_aside(tmp_path):
    s = session(tmp_path)
    save(s, 3)
    (tmp_path / "final").mkdir()
    (tmp_path / "step_000009.tmp").mkdir()
    p = checkpoints.resume_or_clear(cfg(Resume.never), s)
    assert (p.step, p.epoch, p.packs_done) == (0, 0, 0)
    assert s.accelerator.loaded == []
    assert [d.name for d in tmp_path.iterdir()] == [".replaced"]  # deleted at this run's first checkpoint
    assert sorted(d.name for d in (tmp_path / ".replaced" / "000").iterdir()) == [
        "final",
        "step_000003",
        "step_000009.tmp",
    ]


def test_resume_auto_without_a_complete_checkpoint_starts_fresh_and_sets_half_written_ones_aside(tmp_path):
    s = session(tmp_path)
    (tmp_path / "step_000002.tmp").mkdir()
    p = checkpoints.resume_or_clear(cfg(), s)
    assert (p.step, s.accelerator.loaded) == (0, [])
    assert [d.name for d in tmp_path.iterdir()] == [".replaced"]


def test_only_the_main_process_clears(tmp_path):
    s = session(tmp_path)
    save(s, 3)
    s.accelerator.is_main_process = False
    checkpoints.resume_or_clear(cfg(Resume.never), s)
    assert (tmp_path / "step_000003").is_dir()


def test_a_checkpoint_from_before_the_global_position_is_refused_in_one_line(tmp_path):
    """Checkpoints written before packs_done_in_epoch (they counted one rank's micro-batches) are not read
    through a compatibility path: refused, with the fix, before anything is loaded."""
    s = session(tmp_path)
    checkpoints.save(
        s,
        {"optimizer_step": 5, "epoch": 1, "batches_done_in_epoch": 3, "seed": 0, "upstream": dict(UPSTREAM)},
        3,
    )
    with pytest.raises(UserError, match="written by an older eaglepipe") as e:
        checkpoints.resume_or_clear(cfg(), s)
    assert "train.resume=never" in str(e.value) and "\n" not in str(e.value)
    assert s.accelerator.loaded == []
