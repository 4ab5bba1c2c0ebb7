"""eval.sets (issue #17): MT-bench's and HumanEval's real prompt files, read from their PyPI wheels, give one
tau table per set; an unknown set name is refused before anything runs."""

import json
import shutil
from pathlib import Path

import pytest

from pipeline.acceptance.prompts import set_prompts
from pipeline.data import prompt_sets
from pipeline.errors import UserError
from pipeline.runner import run_stages

pytestmark = pytest.mark.slow


def test_the_sets_are_the_real_files():
    mt, he = prompt_sets.load("mt_bench"), prompt_sets.load("humaneval")
    assert len(mt) == 80 and mt[0]["id"] == "81" and mt[0]["category"] == "writing"
    assert len(he) == 164 and he[0]["id"] == "HumanEval/0" and "def has_close_elements" in he[0]["text"]


def test_evaluate_writes_a_tau_table_per_set_from_one_load_of_the_target(
    exported_run, make_cfg, tmp_path, monkeypatch
):
    """Every set, and mt_bench_turn2's first answers, run on one load of the fp32 target (an 8B target is 32
    GB to
    load), released at the end of the stage."""
    from pipeline.acceptance import offline
    from pipeline.models import targets

    loads = []
    real_load = targets.load_model
    monkeypatch.setattr(targets, "load_model", lambda *a, **k: loads.append(a[0]) or real_load(*a, **k))
    run_dir = tmp_path / "run"
    shutil.copytree(exported_run[0], run_dir)
    sets = ["heldout", "mt_bench", "mt_bench_turn2", "humaneval"]
    cfg = make_cfg(
        "+experiment=tiny",
        "data.limit=16",
        "stage=evaluate",
        f"eval.sets=[{','.join(sets)}]",
        "eval.num_prompts=2",
        "eval.max_draft=2",
        "eval.max_new_tokens=8",
        "eval.first_answer_tokens=6",
        run_dir=run_dir,
    )
    run_stages(cfg)
    assert len(loads) == 1 and offline._HELD == {}
    table = json.loads((run_dir / "eval" / "sets.json").read_text())
    assert list(table) == sets
    for name, row in table.items():
        assert (
            row["prompts"] == 2
            and set(row["tau"]) == {"1", "2"}
            and all(t >= 1.0 for t in row["tau"].values())
        )
        where = run_dir / "eval" / ("" if name == "heldout" else name) / "acceptance.json"
        report = json.loads(where.read_text())
        assert report["trained"]["1"]["greedy_mismatches"] == 0
        assert (
            row["teacher_forced_acc_0"] == report["teacher_forced_acc_0"]["trained"]
        )  # the set's own, per row
        assert 0 <= row["teacher_forced_acc_0"] <= 1


def test_an_unknown_set_is_one_line(make_cfg, tmp_path):
    with pytest.raises(
        UserError, match=r"eval.sets=\['heldout', 'gsm9k'\]: a list of distinct names from heldout"
    ):
        run_stages(
            make_cfg("+experiment=tiny", "stage=evaluate", "eval.sets=[heldout,gsm9k]", run_dir=tmp_path)
        )


def test_mt_bench_turn2_asks_the_second_turn_after_the_targets_own_greedy_first_answer(
    exported_run, make_cfg, tmp_path
):
    """Each mt_bench_turn2 prompt is first turn, the target's greedy answer (transformers' generate in fp32
    as the
    independent reference), second turn, through the chat template; the stage writes its tau row."""
    import torch

    from pipeline.acceptance import offline
    from pipeline.capture import features
    from pipeline.models import targets

    run_dir = tmp_path / "run"
    shutil.copytree(exported_run[0], run_dir)
    cfg = make_cfg(
        "+experiment=tiny",
        "data.limit=16",
        "stage=evaluate",
        "eval.sets=[mt_bench_turn2]",
        "eval.num_prompts=2",
        "eval.max_draft=2",
        "eval.max_new_tokens=8",
        "eval.first_answer_tokens=6",
        run_dir=run_dir,
    )
    store = features.open_source(cfg)
    folder = Path(store.facts["target_path"])
    tok = targets.load_tokenizer(folder, cfg.target)
    model = targets.load_model(folder, cfg.target, torch.device("cpu"), torch.float32, "sdpa")
    rows = [r for r in prompt_sets.load("mt_bench") if len(r["turns"]) > 1][:2]
    expected = []
    for r in rows:
        first = tok.apply_chat_template(
            [{"role": "user", "content": r["turns"][0]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        out = model.generate(
            torch.tensor([list(first)]),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )[0, len(first) :]
        answer = tok.decode(out, skip_special_tokens=True).strip()
        assert answer  # a reply of some tokens: the check below would pass vacuously on an empty one
        expected.append(
            list(
                tok.apply_chat_template(
                    [
                        {"role": "user", "content": r["turns"][0]},
                        {"role": "assistant", "content": answer},
                        {"role": "user", "content": r["turns"][1]},
                    ],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            )
        )
    got = set_prompts(cfg, store, "mt_bench_turn2", 2, cfg.eval.prompt_tokens, offline)
    assert got == expected
    run_stages(cfg)
    table = json.loads((run_dir / "eval" / "sets.json").read_text())
    assert list(table) == ["mt_bench_turn2"] and table["mt_bench_turn2"]["prompts"] == 2
