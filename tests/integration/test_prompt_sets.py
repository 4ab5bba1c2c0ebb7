"""eval.sets (issue #17): MT-bench's and HumanEval's real prompt files, read from their PyPI wheels, give one
tau table per set; an unknown set name is refused before anything runs."""

import json
import shutil

import pytest

from pipeline.data import prompt_sets
from pipeline.errors import UserError
from pipeline.runner import run_stages

pytestmark = pytest.mark.slow


def test_the_sets_are_the_real_files():
    mt, he = prompt_sets.load("mt_bench"), prompt_sets.load("humaneval")
    assert len(mt) == 80 and mt[0]["id"] == "81" and mt[0]["category"] == "writing"
    assert len(he) == 164 and he[0]["id"] == "HumanEval/0" and "def has_close_elements" in he[0]["text"]


def test_evaluate_writes_a_tau_table_per_set(exported_run, make_cfg, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(exported_run[0], run_dir)
    cfg = make_cfg("+experiment=tiny", "data.limit=16", "stage=evaluate", "eval.sets=[heldout,mt_bench,humaneval]",
                   "eval.num_prompts=2", "eval.max_draft=2", "eval.max_new_tokens=8", run_dir=run_dir)
    run_stages(cfg)
    table = json.loads((run_dir / "eval" / "sets.json").read_text())
    assert list(table) == ["heldout", "mt_bench", "humaneval"]
    for name, row in table.items():
        assert row["prompts"] == 2 and set(row["tau"]) == {"1", "2"} and all(t >= 1.0 for t in row["tau"].values())
        where = run_dir / "eval" / ("" if name == "heldout" else name) / "acceptance.json"
        assert json.loads(where.read_text())["trained"]["1"]["greedy_mismatches"] == 0


def test_an_unknown_set_is_one_line(make_cfg, tmp_path):
    with pytest.raises(UserError, match=r"eval.sets=\['heldout', 'gsm9k'\]: a list of distinct names from heldout"):
        run_stages(make_cfg("+experiment=tiny", "stage=evaluate", "eval.sets=[heldout,gsm9k]", run_dir=tmp_path))
