"""The stage runner (pipeline/runner.py): order, skipping by fingerprint, the preflight, tools vs stages.

Each stage module is replaced by a fake that records what the runner asked of it, so these tests see the
runner's decisions only, in milliseconds.
"""

import json
import logging
import sys
import types

import pytest
from omegaconf import OmegaConf

from pipeline import runner as stages
from pipeline.errors import UserError


class Fake:
    """A stage module: fingerprint/is_complete/check/run, with what was called in `calls` (shared)."""

    def __init__(self, name, calls, fp="fp0", complete=True, problem=None):
        self.name, self.calls, self.fp, self.complete, self.problem = name, calls, fp, complete, problem

    def module(self):
        m = types.ModuleType(f"pipeline.fake.{self.name}")
        m.fingerprint = lambda cfg: self.fp
        m.is_complete = lambda cfg: self.complete
        m.run = self.run
        m.check = self.check
        return m

    def check(self, cfg):
        self.calls.append(("check", self.name))
        if self.problem:
            raise UserError(self.problem)

    def run(self, cfg):
        self.calls.append(("run", self.name))
        return f"{cfg.run_dir}/{self.name}"


@pytest.fixture
def fakes(monkeypatch):
    calls = []
    made = {name: Fake(name, calls) for name in stages.ORDER + stages.TOOLS}
    for name, fake in made.items():
        pkg = "tools" if name in stages.TOOLS else "stages"
        monkeypatch.setitem(sys.modules, f"pipeline.{pkg}.{name}", fake.module())
    reported = []
    monkeypatch.setattr(
        "pipeline.formats.summary.report",
        lambda run_dir, order, ran: reported.append((list(order), set(ran))),
    )
    return types.SimpleNamespace(made=made, calls=calls, reported=reported)


def cfg_for(stage, run_dir, features="offline"):
    # the sections the runner's own cross-stage checks read (resume vs a rebuilt vocab, the held-out split,
    # where the states come from)
    return OmegaConf.create(
        {
            "stage": stage,
            "run_dir": str(run_dir),
            "train": {"resume": "auto", "val_fraction": 0.1, "features": features},
            "vocab": {"draft_vocab_size": 8},
            "extract": {"aux_layers": None},
            "target": {"source": "tiny", "num_layers": 8},
            "export": {"engines": ["sglang"]},
            "data": {"limit": None},
        }
    )


def runs(calls):
    return [name for what, name in calls if what == "run"]


def test_stage_all_runs_every_stage_in_data_flow_order_and_records_each(fakes, tmp_path):
    calls = fakes.calls
    reported = fakes.reported
    stages.run_stages(cfg_for("all", tmp_path))
    assert runs(calls) == ["prepare", "extract", "vocab", "train", "export", "evaluate"]
    records = json.loads((tmp_path / "stages.json").read_text())
    assert sorted(records) == sorted(stages.ORDER)
    assert records["train"]["fingerprint"] == "fp0"
    assert records["train"]["output"] == f"{tmp_path}/train"
    assert reported == [(stages.ORDER, set(stages.ORDER))]


def test_every_check_runs_before_the_first_stage(fakes, tmp_path):
    calls = fakes.calls
    stages.run_stages(cfg_for("all", tmp_path))
    first_run = calls.index(("run", "prepare"))
    assert calls[:first_run] == [("check", n) for n in stages.ORDER]


def test_a_stage_with_the_recorded_fingerprint_and_complete_output_is_skipped(fakes, tmp_path):
    calls = fakes.calls
    reported = fakes.reported
    stages.run_stages(cfg_for("all", tmp_path))
    calls.clear()
    stages.run_stages(cfg_for("all", tmp_path))
    assert runs(calls) == []
    assert reported[-1] == (stages.ORDER, set())  # the summary still comes, nothing ran


def test_a_changed_fingerprint_reruns_that_stage_only(fakes, tmp_path):
    made = fakes.made
    calls = fakes.calls
    stages.run_stages(cfg_for("all", tmp_path))
    calls.clear()
    made["train"].fp = "fp1"  # the runner sees only fingerprints: downstream stages change theirs themselves
    stages.run_stages(cfg_for("all", tmp_path))
    assert runs(calls) == ["train"]
    assert json.loads((tmp_path / "stages.json").read_text())["train"]["fingerprint"] == "fp1"


def test_an_incomplete_output_reruns_the_stage_despite_the_same_fingerprint(fakes, tmp_path):
    made = fakes.made
    calls = fakes.calls
    stages.run_stages(cfg_for("all", tmp_path))
    calls.clear()
    made["vocab"].complete = False
    stages.run_stages(cfg_for("all", tmp_path))
    assert runs(calls) == ["vocab"]


def test_one_stage_runs_alone_and_keeps_the_other_records(fakes, tmp_path):
    calls = fakes.calls
    reported = fakes.reported
    stages.write_record(tmp_path, "prepare", {"fingerprint": "old"})
    stages.run_stages(cfg_for("vocab", tmp_path))
    assert runs(calls) == ["vocab"]
    assert [c for c in calls if c[0] == "check"] == [("check", "vocab")]
    records = stages.read_records(tmp_path)
    assert records["prepare"] == {"fingerprint": "old"} and records["vocab"]["fingerprint"] == "fp0"
    assert reported == []  # the summary closes stage=all only


@pytest.mark.parametrize("tool", stages.TOOLS)
def test_a_tool_runs_without_checks_fingerprints_or_records(fakes, tmp_path, tool):
    calls = fakes.calls
    reported = fakes.reported
    stages.run_stages(cfg_for(tool, tmp_path / "run"))
    assert calls == [("run", tool)]
    if tool in stages.WRITING_TOOLS:  # parity/, tune/: one run at a time (#35 rule 2), its lock released
        assert [p.name for p in (tmp_path / "run").iterdir()] == ["run.lock"]
        assert (tmp_path / "run" / "run.lock").read_text() == ""
    else:
        assert not (tmp_path / "run").exists()  # a tool that only reads writes nothing into a run dir
    assert reported == []


def test_every_problem_of_every_selected_stage_is_reported_before_anything_runs(fakes, tmp_path):
    made = fakes.made
    calls = fakes.calls
    made["train"].problem, made["evaluate"].problem = (
        "train.lr=0 must be > 0",
        "eval.max_draft=0 must be >= 1",
    )
    with pytest.raises(UserError) as e:
        stages.run_stages(cfg_for("all", tmp_path / "run"))
    assert str(e.value) == "train: train.lr=0 must be > 0; evaluate: eval.max_draft=0 must be >= 1"
    assert runs(calls) == []
    assert not (tmp_path / "run").exists()


def test_a_stage_without_check_is_run_plainly(fakes, monkeypatch, tmp_path):
    made = fakes.made
    calls = fakes.calls
    m = made["vocab"].module()
    del m.check
    monkeypatch.setitem(sys.modules, "pipeline.stages.vocab", m)
    stages.run_stages(cfg_for("vocab", tmp_path))
    assert calls == [("run", "vocab")]


def test_stage_enum_values_are_accepted_like_strings(fakes, tmp_path):
    from pipeline.config_choices import Stage

    calls = fakes.calls
    cfg = cfg_for("train", tmp_path)
    cfg.stage = Stage.train
    stages.run_stages(cfg)
    assert runs(calls) == ["train"]


def test_records_are_written_whole_and_read_back(tmp_path):
    assert stages.read_records(tmp_path) == {}
    stages.write_record(tmp_path, "a", {"fingerprint": "x"})
    stages.write_record(tmp_path, "b", {"fingerprint": "y"})
    stages.write_record(tmp_path, "a", {"fingerprint": "z"})
    assert stages.read_records(tmp_path) == {"a": {"fingerprint": "z"}, "b": {"fingerprint": "y"}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stages.json"]  # no .tmp left behind


def test_selected_is_the_order_for_all_and_the_stage_alone_otherwise():
    assert stages.selected("all") == ["prepare", "extract", "vocab", "train", "export", "evaluate"]
    assert stages.selected("export") == ["export"]


def test_a_skipped_stage_whose_input_is_gone_says_so(make_cfg, tmp_path, caplog):
    """Deleting features/manifest.json then stage=vocab (or train) once said only "up to date, skipped"."""
    cfg = make_cfg("+experiment=tiny", "stage=vocab", run_dir=tmp_path)
    import numpy as np
    import torch

    from pipeline.formats import vocab_map
    from pipeline.stages import vocab

    t2d = torch.arange(1024) < 256  # a complete vocab (the first 256 ids): is_complete reads it whole
    vocab_map.save(tmp_path / "vocab", torch.zeros(256, dtype=torch.int64), t2d, np.ones(1024), {})

    stages.write_record(
        tmp_path, "vocab", {"fingerprint": vocab.fingerprint(cfg)}
    )  # as if built, then features deleted
    caplog.set_level(logging.INFO)
    stages.run_stages(cfg)
    assert "stage vocab: up to date" in caplog.text
    assert f"1 of its inputs are gone ({tmp_path}/features/manifest.json)" in caplog.text


def test_online_features_skip_extract_in_stage_all_and_refuse_it_alone(fakes, tmp_path):
    stages.run_stages(cfg_for("all", tmp_path / "run", features="online"))
    assert runs(fakes.calls) == [n for n in stages.ORDER if n != "extract"]
    assert ("check", "extract") not in fakes.calls
    with pytest.raises(UserError, match="train.features=online writes no feature store"):
        stages.run_stages(cfg_for("extract", tmp_path / "run2", features="online"))
