"""tau during training (issue #17 item 1): `train.eval_tau_every_steps` logs the tau of the draft as the
export would serve it; `train.select=tau` exports the step with the highest logged tau (at k =
export.serve.num_steps),
and says so; the tau logged at that step is the tau evaluate measures on the export."""

import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.errors import UserError
from pipeline.runner import run_stages
from pipeline.training.checkpoints import BEST_TAU

pytestmark = pytest.mark.slow
# the target's own answers (regenerated), so the tiny draft learns to be accepted within a few dozen steps
COMMON = [
    "+experiment=tiny",
    "prepare.regenerate=true",
    "prepare.max_new_tokens=24",
    "prepare.max_assistant_turns=3",
    "data.limit=48",
    "train.max_steps=30",
    "train.epochs=20",
    "train.eval_tau_every_steps=6",
    "train.select=tau",
    "train.val_every_steps=1000",
    "export.engines=[sglang]",
    "export.verify_in_engine=false",
    "eval.num_prompts=3",
    "eval.max_new_tokens=12",
    "eval.max_draft=3",
    "export.serve.num_steps=2",
    "train.val_fraction=0.3",
]  # two halves of held-out samples: the probe's and evaluate's


@pytest.fixture(scope="module")
def run(make_cfg, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tau_in_training")
    for stage in ("prepare", "extract", "vocab", "train", "export", "evaluate"):
        run_stages(make_cfg(*COMMON, f"stage={stage}", run_dir=run_dir))
    return run_dir


def _taus(run_dir):
    rows = [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "tau"]


def test_tau_is_logged_every_n_steps_and_at_the_last_for_every_k(run):
    taus = _taus(run)
    assert [r["step"] for r in taus] == [6, 12, 18, 24, 30]
    assert all({"k=1", "k=2", "k=3"} <= set(r) and all(r[f"k={k}"] >= 1.0 for k in (1, 2, 3)) for r in taus)
    assert len({r["k=2"] for r in taus}) > 1, (
        "tau never moved: the test cannot tell a selection from a default"
    )


def test_select_tau_exports_the_step_with_the_highest_logged_tau(run):
    taus = _taus(run)
    best = max(taus, key=lambda r: r["k=2"])  # the first of equal maxima, as train keeps the first
    summary = json.loads((run / "train" / "final" / "train_summary.json").read_text())
    assert summary["selected"]["by"] == "tau" and summary["selected"]["k"] == 2
    assert summary["selected"]["step"] == best["step"] and summary["selected"]["tau"] == best["k=2"]
    manifest = json.loads((run / "export" / "sglang" / "export_manifest.json").read_text())
    assert manifest["selected"] == summary["selected"]
    exported = load_file(str(run / "export" / "sglang" / "model.safetensors"))
    chosen = load_file(str(run / "train" / "best_tau" / "model.safetensors"))
    assert torch.equal(exported["fc.weight"], chosen["fc.weight"].bfloat16())
    if best["step"] != 30:  # the export is not the last step's weights
        last = load_file(str(run / "train" / "final" / "model.safetensors"))
        assert not torch.equal(exported["fc.weight"], last["fc.weight"].bfloat16())


def test_evaluate_never_reports_on_the_prompts_the_checkpoint_was_chosen_on(run):
    """select=tau picks on the probe's prompts (the selection half of the held-out samples); a tau measured
    on those
    overstates the draft, so evaluate's heldout set is the other half: disjoint samples, disjoint prompts."""
    from pipeline.data import prompt_sets
    from pipeline.formats import feature_store as fs

    val = json.loads((run / "train" / "final" / "train_summary.json").read_text())["val_samples"]
    selection, report = prompt_sets.selection_and_report(val)
    assert (
        selection
        and report
        and not set(selection) & set(report)
        and sorted(selection + report) == sorted(val)
    )
    store = fs.FeatureStore(run / "features")
    chosen_on = prompt_sets.before_answer(store, selection, 3, 384)
    reported = prompt_sets.before_answer(store, report, 3, 384)
    assert chosen_on and reported and not {tuple(p) for p in chosen_on} & {tuple(p) for p in reported}
    measured = json.loads((run / "eval" / "acceptance.json").read_text())
    assert measured["prompts"] == len(reported)


def test_select_tau_without_tau_steps_is_refused_in_one_line(make_cfg, tmp_path):
    with pytest.raises(
        UserError, match="train.select=tau picks the step of the highest tau: set train.eval_tau_every_steps"
    ):
        run_stages(make_cfg("+experiment=tiny", "train.select=tau", "stage=train", run_dir=tmp_path))


def test_select_tau_turned_on_for_a_run_finished_with_select_last_probes_its_last_step(make_cfg, tmp_path):
    """A run trained to its end with select=last, then the same command with select=tau: train resumes at the
    last
    step, where no tau was ever logged, probes it once, and the export takes that step (best_tau == final)."""
    base = [
        "+experiment=tiny",
        "data.limit=48",
        "train.max_steps=12",
        "train.save_every_steps=6",
        "train.val_every_steps=1000",
        "export.engines=[sglang]",
        "export.verify_in_engine=false",
        "eval.num_prompts=2",
        "eval.max_new_tokens=8",
        "eval.max_draft=2",
        "export.serve.num_steps=2",
    ]
    for stage in ("prepare", "extract", "vocab", "train"):
        run_stages(make_cfg(*base, f"stage={stage}", run_dir=tmp_path))
    assert not _taus(tmp_path)
    run_stages(
        make_cfg(*base, "train.select=tau", "train.eval_tau_every_steps=5", "stage=train", run_dir=tmp_path)
    )
    taus = _taus(tmp_path)
    assert [r["step"] for r in taus] == [12]  # resumed at the end: no step ran, the last one was probed
    summary = json.loads((tmp_path / "train" / "final" / "train_summary.json").read_text())
    assert summary["selected"]["by"] == "tau" and summary["selected"]["step"] == 12
    assert summary["selected"]["tau"] == taus[0]["k=2"]
    best = load_file(str(tmp_path / "train" / BEST_TAU / "model.safetensors"))
    final = load_file(str(tmp_path / "train" / "final" / "model.safetensors"))
    assert best.keys() == final.keys() and all(torch.equal(best[k], final[k]) for k in best)
