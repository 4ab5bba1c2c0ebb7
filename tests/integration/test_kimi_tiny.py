"""Kimi-K2.5's own architecture family end to end, small (issue #13): `target=kimi_tiny` (a random-init
DeepseekV3ForCausalLM: MLA attention, MoE with a shared expert, the first layer dense) through every stage on
CPU with the hf capture backend and the Llama-layout draft; both exports verified through SGLang's and vLLM's
own classes, and SGLang's DeepSeek-V3 class asked which layers it captures for the exported ids.

Aux layers [2, 3, 5] on purpose: SGLang's DeepSeek classes read ids whose first element is not 1 as "capture
before these layers" (export_layouts.SGLANG_FIRST_ID_RULE), so the SGLang export must say [3, 4, 6]; Llama's
numbering ([2, 3, 5]) would make the served target feed the draft the outputs of layers [1, 2, 4]."""

import json

import pytest

from exported_forward import exported_minus_speculators_logits
from mutations import mutated_copy
from pipeline.runner import run_stages
from pipeline.tools.verify import check_export, engine_problems, engine_report

pytestmark = pytest.mark.slow
AUX = [2, 3, 5]
RUN = ["+experiment=tiny", "target=kimi_tiny", "data.limit=12", "train.max_steps=3", f"extract.aux_layers={AUX}",
       "eval.num_prompts=2", "eval.max_draft=2"]


@pytest.fixture(scope="module")
def kimi_cfg(make_cfg, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("kimi_run")
    cfg = make_cfg(*RUN, "stage=all", run_dir=run_dir)
    run_stages(cfg)
    return cfg, run_dir


@pytest.fixture(scope="module")
def kimi_run(kimi_cfg):
    run_dir = kimi_cfg[1]
    return run_dir, json.loads((run_dir / "features" / "manifest.json").read_text())["facts"]


def test_every_stage_runs_on_the_deepseek_v3_target_and_both_exports_load_completely(kimi_run):
    run_dir, facts = kimi_run
    stages = json.loads((run_dir / "stages.json").read_text())
    assert set(stages) >= {"prepare", "extract", "vocab", "train", "export", "evaluate"}
    assert facts["aux_layer_ids"] == AUX and facts["hidden_size"] == 128
    for engine, ids, cls in (("sglang", [3, 4, 6], "LlamaForCausalLMEagle3"), ("vllm", [3, 4, 6], "Eagle3LlamaForCausalLM")):
        manifest = json.loads((run_dir / "export" / engine / "export_manifest.json").read_text())
        assert manifest["target_architecture"] == "DeepseekV3ForCausalLM"
        assert manifest["aux_layer_ids_engine"] == ids and manifest["verified_by"]["class"] == cls
    config = json.loads((run_dir / "export" / "sglang" / "config.json").read_text())
    assert config["head_dim"] == 32  # the target's v_head_dim: an MLA target has no single head size
    assert json.loads((run_dir / "eval" / "acceptance.json").read_text())


def test_sglangs_own_deepseek_class_captures_the_layers_the_draft_was_trained_on(kimi_run):
    run_dir, facts = kimi_run
    report = engine_report(run_dir / "export" / "sglang", "sglang", facts["target_path"])
    assert report["target_class"] == "DeepseekV3ForCausalLM"
    assert report["aux_layer_ids_read"] == [3, 4, 6] and report["target_layers_to_capture"] == [3, 4, 6]
    assert engine_problems(report, [3, 4, 6], AUX) == []


@pytest.mark.parametrize("edit,why", [
    (lambda c: c["eagle_config"].pop("eagle_aux_hidden_state_layer_ids"), "ids removed: SGLang's default layers"),
    (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=AUX), "Llama's numbering on a DeepSeek class"),
])
def test_the_aux_capture_check_fails_for_the_kimi_class(kimi_run, tmp_path, edit, why):
    run_dir, facts = kimi_run
    bad = mutated_copy(run_dir / "export" / "sglang", tmp_path / "sglang", config=edit)
    assert check_export(bad, "sglang", facts, "DeepseekV3ForCausalLM"), why
    report = engine_report(bad, "sglang", facts["target_path"])
    found = engine_problems(report, [3, 4, 6], AUX)
    assert any("the target's own DeepseekV3ForCausalLM captures the inputs of layers" in f for f in found), (why, found)


def test_the_offline_bench_reads_the_export_with_the_targets_yarn_rope(kimi_cfg):
    """Kimi's rope is yarn: the offline bench's reference forward once took plain rope from rope_theta alone."""
    cfg, run_dir = kimi_cfg
    assert json.loads((run_dir / "export" / "sglang" / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"
    assert exported_minus_speculators_logits(cfg, run_dir) <= 1e-5
