"""Kimi-K2.5's own architecture family end to end, small (issue #13): `target=kimi_tiny` (a random-init
DeepseekV3ForCausalLM: MLA attention, MoE with a shared expert, the first layer dense) through every stage on
CPU with the hf capture backend, with the Llama-layout draft (both exports verified through SGLang's and
vLLM's own classes) and with the MLA draft (`train.draft_arch=mla`, verified through SGLang's own
Eagle3DeepseekV2ForCausalLM); SGLang's DeepSeek-V3 class asked which layers it captures for the exported ids.

Aux layers [2, 3, 5] on purpose: SGLang's DeepSeek classes read ids whose first element is not 1 as "capture
before these layers" (export_layouts.SGLANG_FIRST_ID_RULE), so the SGLang export must say [3, 4, 6]; Llama's
numbering ([2, 3, 5]) would make the served target feed the draft the outputs of layers [1, 2, 4]."""

import json
import shutil

import pytest
from exported_forward import exported_minus_speculators_logits
from mutations import mutated_copy

from pipeline.engines.verify import check_export, engine_problems, engine_report
from pipeline.formats import sglang_params as sgl_params
from pipeline.runner import run_stages

pytestmark = pytest.mark.slow
AUX = [2, 3, 5]
RUN = [
    "+experiment=tiny",
    "target=kimi_tiny",
    "data.limit=12",
    "train.max_steps=3",
    f"extract.aux_layers={AUX}",
    "eval.num_prompts=2",
    "eval.max_draft=2",
]


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
    for engine, ids, cls in (
        ("sglang", [3, 4, 6], "LlamaForCausalLMEagle3"),
        ("vllm", [3, 4, 6], "Eagle3LlamaForCausalLM"),
    ):
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


@pytest.mark.parametrize(
    "edit,why",
    [
        (
            lambda c: c["eagle_config"].pop("eagle_aux_hidden_state_layer_ids"),
            "ids removed: SGLang's default layers",
        ),
        (
            lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=AUX),
            "Llama's numbering on a DeepSeek class",
        ),
    ],
)
def test_the_aux_capture_check_fails_for_the_kimi_class(kimi_run, tmp_path, edit, why):
    run_dir, facts = kimi_run
    bad = mutated_copy(run_dir / "export" / "sglang", tmp_path / "sglang", config=edit)
    assert check_export(bad, "sglang", facts, "DeepseekV3ForCausalLM"), why
    report = engine_report(bad, "sglang", facts["target_path"])
    found = engine_problems(report, [3, 4, 6], AUX)
    assert any("the target's own DeepseekV3ForCausalLM captures the inputs of layers" in f for f in found), (
        why,
        found,
    )


def test_the_offline_bench_reads_the_export_with_the_targets_yarn_rope(kimi_cfg):
    """Kimi's rope is yarn: the offline bench's reference forward once took plain rope from rope_theta
    alone."""
    cfg, run_dir = kimi_cfg
    assert (
        json.loads((run_dir / "export" / "sglang" / "config.json").read_text())["rope_parameters"][
            "rope_type"
        ]
        == "yarn"
    )
    assert exported_minus_speculators_logits(cfg, run_dir) <= 1e-5


# ---- the MLA draft: the same prepared data, store and vocab; trained, exported, evaluated again ----
MLA = ["train.draft_arch=mla", "export.engines=[sglang]"]
ATTN = "midlayer.self_attn."


@pytest.fixture(scope="module")
def mla_cfg(kimi_cfg, make_cfg, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("kimi_mla") / "run"
    shutil.copytree(kimi_cfg[1], run_dir, ignore=shutil.ignore_patterns("train", "export", "eval"))
    cfg = make_cfg(*RUN, *MLA, "stage=all", run_dir=run_dir)
    run_stages(cfg)
    return cfg, run_dir


def test_the_mla_draft_trains_on_the_same_store_and_loads_completely_into_sglangs_mla_class(
    mla_cfg, kimi_run
):
    _, run_dir = mla_cfg
    facts = kimi_run[1]
    stages, first = (json.loads((d / "stages.json").read_text()) for d in (run_dir, kimi_run[0]))
    assert stages["extract"] == first["extract"] and stages["train"]["output"] == str(
        run_dir / "train"
    )  # one store
    manifest = json.loads((run_dir / "export" / "sglang" / "export_manifest.json").read_text())
    assert (
        manifest["draft_arch"] == "mla" and manifest["verified_by"]["class"] == "Eagle3DeepseekV2ForCausalLM"
    )
    assert manifest["aux_layer_ids_engine"] == [3, 4, 6]
    config = json.loads((run_dir / "export" / "sglang" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["kv_lora_rank"] == 512
    # one latent + one rope key per token (576 x bf16), against the Llama draft's 4 KV heads x 32 x K,V
    assert manifest["draft_kv_bytes_per_token"] == 1152
    llama = json.loads((kimi_run[0] / "export" / "sglang" / "export_manifest.json").read_text())
    assert llama["draft_kv_bytes_per_token"] == 512
    report = engine_report(run_dir / "export" / "sglang", "sglang", facts["target_path"])
    assert engine_problems(report, [3, 4, 6], AUX) == []
    assert report["target_layers_to_capture"] == [3, 4, 6]
    # the loader concatenates q_a + kv_a before writing: consumed, found by content in the fused parameter
    assert report["consumed_fused"] == [ATTN + "kv_a_proj_with_mqa.weight", ATTN + "q_a_proj.weight"]
    # the engine-free replay's parameter table is the class's own
    shape = sgl_params.MLAShape(
        hidden=128,
        target_hidden=128,
        n_aux=3,
        heads=4,
        q_lora=64,
        kv_lora=512,
        rope=64,
        nope=32,
        v=32,
        intermediate=256,
        vocab=1024,
        draft_vocab=config["draft_vocab_size"],
    )
    assert {k: list(v) for k, v in sgl_params.sglang_mla_param_table(shape).items()} == report["parameters"]
    tau = json.loads((run_dir / "eval" / "acceptance.json").read_text())
    assert all(tau["trained"][k]["greedy_mismatches"] == 0 for k in ("1", "2"))


def test_the_offline_bench_reads_the_mla_export_as_speculators_computes_it(mla_cfg):
    cfg, run_dir = mla_cfg
    assert exported_minus_speculators_logits(cfg, run_dir) <= 1e-5


def _drop(name):
    def edit(t):
        t.pop(name)
        return t

    return edit


def _rename(old, new):
    def edit(t):
        t[new] = t.pop(old)
        return t

    return edit


@pytest.mark.parametrize(
    "edit,why",
    [
        (
            _drop(ATTN + "kv_a_proj_with_mqa.weight"),
            "q_a waits for kv_a forever: the fused projection never written",
        ),
        (
            _rename(ATTN + "kv_b_proj.weight", ATTN + "kv_up_proj.weight"),
            "a name the class skips with a log warning only",
        ),
    ],
)
def test_a_broken_mla_export_fails_both_the_replay_and_sglangs_own_loader(
    mla_cfg, kimi_run, tmp_path, edit, why
):
    run_dir, facts = mla_cfg[1], kimi_run[1]
    bad = mutated_copy(run_dir / "export" / "sglang", tmp_path / "sglang", tensors=edit)
    replay = check_export(bad, "sglang", facts, "DeepseekV3ForCausalLM")
    assert any("never written" in p or "drop" in p for p in replay), (why, replay)
    found = engine_problems(engine_report(bad, "sglang", facts["target_path"]), [3, 4, 6], AUX)
    assert any("silently dropped" in f for f in found) and any("not written" in f for f in found), (
        why,
        found,
    )


def test_the_mla_tensors_under_the_llama_class_name_are_refused(mla_cfg, kimi_run, tmp_path):
    run_dir, facts = mla_cfg[1], kimi_run[1]
    bad = mutated_copy(
        run_dir / "export" / "sglang",
        tmp_path / "sglang",
        config=lambda c: c.update(architectures=["LlamaForCausalLMEagle3"]),
    )
    assert check_export(bad, "sglang", facts, "DeepseekV3ForCausalLM")


def test_the_mla_draft_is_refused_for_a_target_without_mla(tiny_folder):
    from transformers import AutoConfig

    from pipeline.errors import UserError
    from pipeline.models import draft

    with pytest.raises(UserError, match="use train.draft_arch=llama"):
        draft.build(
            None,
            AutoConfig.from_pretrained(tiny_folder),
            [1],
            None,
            None,
            1,
            load_target_weights=False,
            draft_vocab_size=8,
            arch="mla",
        )
