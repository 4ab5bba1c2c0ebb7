"""A full-vocabulary draft (vocab.draft_vocab_size = the target's vocabulary, as TorchSpec trains Kimi drafts
over all 163,840 ids) runs end to end: speculators registers no d2t/t2d for it, neither engine wants one
(SGLang: "absent in checkpoints whose draft_vocab_size equals vocab_size", hot_token_id None; vLLM builds no
draft_id_to_target_id), and each engine's own class loads the export (pipeline/formats/vocab_map.py::full).
A draft vocabulary larger than the target's is refused in one line before any stage runs."""

import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.engines.verify import check_export, verify_export
from pipeline.errors import UserError
from pipeline.formats.feature_store import FeatureStore
from pipeline.runner import run_stages

pytestmark = pytest.mark.slow
V = 1024  # conf/target/tiny.yaml
ENGINES = {"sglang": "LlamaForCausalLMEagle3", "vllm": "Eagle3LlamaForCausalLM"}


@pytest.fixture(scope="module")
def full_vocab_run(make_cfg, tmp_path_factory):
    """stage=all through evaluate; the exports' in-engine check runs in the test below (once, not twice)."""
    run_dir = tmp_path_factory.mktemp("full_vocab")
    cfg = make_cfg(
        "+experiment=tiny",
        "data.limit=16",
        "train.max_steps=4",
        "train.eval_tau_every_steps=4",  # the in-training tau probe reads the draft as exported, too
        "export.verify_in_engine=false",
        f"vocab.draft_vocab_size={V}",
        run_dir=run_dir,
    )
    run_stages(cfg)
    return run_dir, FeatureStore(run_dir / "features").facts


@pytest.mark.parametrize("engine", list(ENGINES))
def test_correct_result_full_vocabulary_draft_exports_without_d2t_and_loads_in_the_engine(
    full_vocab_run, engine
):
    run_dir, facts = full_vocab_run
    vocab = json.loads((run_dir / "vocab" / "manifest.json").read_text())
    assert vocab["draft_vocab_size"] == V == vocab["target_vocab_size"] and vocab["coverage"] == 1.0
    folder = run_dir / "export" / engine
    tensors = load_file(str(folder / "model.safetensors"))
    assert "d2t" not in tensors and "t2d" not in tensors and tensors["lm_head.weight"].shape[0] == V
    assert json.loads((folder / "config.json").read_text())["draft_vocab_size"] == V
    manifest = json.loads((folder / "export_manifest.json").read_text())
    # export's own verification, in the engine's own class and loader
    problems, report = verify_export(
        folder, engine, facts, manifest["target_path"], True, None, manifest["target_architecture"]
    )
    assert problems == [] and report["class"] == ENGINES[engine]
    # SGLang: hot_token_id None and logits over the whole vocabulary; vLLM: no draft_id_to_target_id
    assert report["hot_token_id_ok"] is True and report["dropped"] == [] and report["unwritten"] == []


def test_correct_result_full_vocabulary_draft_evaluates_tau_equal_to_greedy(full_vocab_run):
    run_dir, _ = full_vocab_run
    rows = [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in rows if r["split"] == "tau"], "the in-training tau probe did not run"
    report = json.loads((run_dir / "eval" / "acceptance.json").read_text())
    for name in ("trained", "untrained"):
        for k, r in report[name].items():
            assert r["greedy_mismatches"] == 0 and r["tau"] >= 1.0 and len(r["accept_per_position"]) == int(k)


def identity_mapping(t):
    t["d2t"], t["t2d"] = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    return t


def test_correct_result_full_vocabulary_d2t_is_refused_for_vllm_only(full_vocab_run, mutate, tmp_path):
    """vLLM builds no draft_id_to_target_id at a full vocabulary: its loader raises `no module or parameter
    named 'draft_id_to_target_id'` on a d2t (seen in vLLM 0.33.0's own class); SGLang loads an all-zero d2t as
    hot_token_id = arange."""
    run_dir, facts = full_vocab_run
    vllm = mutate(run_dir / "export" / "vllm", tmp_path / "vllm", tensors=identity_mapping)
    assert any("full-vocabulary draft" in p and "vLLM" in p for p in check_export(vllm, "vllm", facts))
    sglang = mutate(run_dir / "export" / "sglang", tmp_path / "sglang", tensors=identity_mapping)
    assert check_export(sglang, "sglang", facts) == []


def test_refused_before_work_draft_vocabulary_larger_than_the_target(make_cfg, tmp_path):
    with pytest.raises(UserError, match=rf"vocab.draft_vocab_size={V + 1}: must be in \[1, {V}\]"):
        run_stages(make_cfg("+experiment=tiny", f"vocab.draft_vocab_size={V + 1}", run_dir=tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # no stage ran: nothing prepared, no stages.json
