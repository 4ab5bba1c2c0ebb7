"""Exports load completely by construction, and every seed failure injected into a good export is caught."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.export import check_export, engine_problems, sglang_engine_report
from pipeline.formats.feature_store import FeatureStore
from pipeline.stages import run_stages

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exported(make_cfg, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("export_run")
    run_stages(make_cfg("+experiment=tiny", "data.limit=16", "train.max_steps=4", run_dir=run_dir))
    return run_dir, FeatureStore(run_dir / "features").facts


def test_exports_pass_their_checks_with_engine_numbering_and_layout(exported):
    run_dir, facts = exported
    sg = json.loads((run_dir / "export" / "sglang" / "config.json").read_text())
    vl = json.loads((run_dir / "export" / "vllm" / "config.json").read_text())
    assert sg["architectures"] == ["LlamaForCausalLMEagle3"] and sg["draft_vocab_size"] == 256
    assert sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == facts["aux_layer_ids"] == [1, 3, 4]
    assert vl["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM id = eaglepipe id + 1
    sg_keys = load_file(str(run_dir / "export" / "sglang" / "model.safetensors")).keys()
    assert any(k.startswith("midlayer.") for k in sg_keys) and not any(k.startswith("layers.") for k in sg_keys)
    assert "embed_tokens.weight" not in sg_keys  # SGLang always takes the target's embedding for EAGLE3
    for engine in ("sglang", "vllm"):
        assert check_export(run_dir / "export" / engine, engine, facts) == []
        assert "EAGLE3" in (run_dir / "export" / engine / "serve.sh").read_text().upper()


def _mutated(run_dir, tmp_path, engine, tensors=None, config=None):
    folder = tmp_path / engine
    shutil.copytree(run_dir / "export" / engine, folder)
    if tensors:
        t = load_file(str(folder / "model.safetensors"))
        save_file(tensors(t), str(folder / "model.safetensors"))
    if config:
        c = json.loads((folder / "config.json").read_text())
        config(c)
        (folder / "config.json").write_text(json.dumps(c))
    return folder


def _rename_all(t, prefix):
    return {(prefix + k if k not in ("d2t", "t2d") else k): v for k, v in t.items()}


def _absolute_d2t(t):
    t["d2t"] = t["d2t"] + torch.arange(len(t["d2t"]))
    return t


def _zero_fc(t):
    t["fc.weight"] = torch.zeros_like(t["fc.weight"])
    return t


def _single_layer_fc(t):
    t["fc.weight"] = t["fc.weight"][:, : t["fc.weight"].shape[0]].contiguous()
    return t


def _nan(t):
    t["norm.weight"] = t["norm.weight"].clone()
    t["norm.weight"][0] = float("nan")
    return t


MUTATIONS = [
    ("sglang", dict(tensors=lambda t: _rename_all(t, "draft_model.")), "silently drop"),
    ("sglang", dict(config=lambda c: c["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")), "aux layer ids missing"),
    ("sglang", dict(config=lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 5])), r"aux layer ids \[2, 4, 5\] != \[1, 3, 4\]"),
    ("vllm", dict(config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 4])), r"aux layer ids \[1, 3, 4\] != \[2, 4, 5\]"),
    ("sglang", dict(tensors=_absolute_d2t), r"absolute target ids|i \+ d2t\[i\] leaves"),
    ("vllm", dict(tensors=_absolute_d2t), r"absolute target ids|i \+ d2t\[i\] leaves"),
    ("sglang", dict(tensors=_zero_fc), "fc.weight is constant"),
    ("sglang", dict(tensors=_single_layer_fc), "fc.weight takes 64 inputs, expected n_aux x hidden = 3 x 64"),
    ("sglang", dict(config=lambda c: c.pop("draft_vocab_size")), "draft_vocab_size missing"),
    ("sglang", dict(tensors=_nan), "non-finite"),
    ("vllm", dict(tensors=lambda t: _rename_all(t, "draft_model.")), "raises on unknown names"),
]


@pytest.mark.parametrize("engine,mutation,message", MUTATIONS, ids=[f"{e}-{m}" for e, _, m in MUTATIONS])
def test_each_injected_failure_is_caught(exported, tmp_path, engine, mutation, message):
    run_dir, facts = exported
    problems = check_export(_mutated(run_dir, tmp_path, engine, **mutation), engine, facts)
    import re
    assert any(re.search(message, p) for p in problems), problems


def test_sglang_own_class_loads_the_export_completely(exported):
    run_dir, _ = exported
    manifest = json.loads((run_dir / "export" / "sglang" / "export_manifest.json").read_text())
    assert manifest["verified_by"] == {"engine": "sglang", "engine_version": "0.5.23", "class": "LlamaForCausalLMEagle3"}
    report = sglang_engine_report(run_dir / "export" / "sglang")
    assert report["dropped"] == [] and report["unwritten"] == [] and report["hot_token_id_ok"] is True
    assert "lm_head.weight" in report["consumed"] and "midlayer.self_attn.q_proj.weight" in report["consumed"]
    assert report["parameters"]["model.fc.weight"] == [64, 192]


@pytest.mark.parametrize("mutation,message", [
    (dict(tensors=lambda t: _rename_all(t, "draft_model.")), "silently dropped 13 tensors"),
    (dict(tensors=_single_layer_fc), "raised while loading"),
], ids=["draft_model-prefix", "single-layer-fc"])
def test_sglang_own_class_catches_injected_failures(exported, tmp_path, mutation, message):
    run_dir, _ = exported
    problems = engine_problems(sglang_engine_report(_mutated(run_dir, tmp_path, "sglang", **mutation)))
    assert any(message in p for p in problems), problems
