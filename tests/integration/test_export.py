"""Exports load completely by construction, and every failure injected into a good export is caught."""

import json
import logging
import re
import shutil
import subprocess

import pytest
from mutations import absolute_d2t, nan_norm, prefix_keys, single_layer_fc, zero_fc
from safetensors.torch import load_file

from pipeline.engines.verify import (
    ENGINES_PYTHON,
    check_export,
    engine_problems,
    engine_report,
    report_key,
)
from pipeline.formats import engine_memo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exported(exported_run):
    return exported_run


def test_exports_pass_their_checks_with_engine_numbering_and_layout(exported):
    run_dir, facts = exported
    sg = json.loads((run_dir / "export" / "sglang" / "config.json").read_text())
    vl = json.loads((run_dir / "export" / "vllm" / "config.json").read_text())
    assert sg["architectures"] == ["LlamaForCausalLMEagle3"] and sg["draft_vocab_size"] == 256
    assert sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == facts["aux_layer_ids"] == [1, 3, 4]
    assert vl["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM id = eaglepipe id + 1
    sg_keys = load_file(str(run_dir / "export" / "sglang" / "model.safetensors")).keys()
    assert any(k.startswith("midlayer.") for k in sg_keys) and not any(
        k.startswith("layers.") for k in sg_keys
    )
    assert "embed_tokens.weight" not in sg_keys  # SGLang always takes the target's embedding for EAGLE3
    for engine in ("sglang", "vllm"):
        assert check_export(run_dir / "export" / engine, engine, facts) == []
        assert "EAGLE3" in (run_dir / "export" / engine / "serve.sh").read_text().upper()
        serve = json.loads((run_dir / "export" / engine / "export_manifest.json").read_text())["serve"]
        assert (serve["num_steps"], serve["topk"], serve["num_draft_tokens"], serve["chosen_by"]) == (
            3,
            1,
            4,
            {"by": "config"},
        )  # serve.sh's settings, and that export.serve chose them (tune-serve: measurement)


MUTATIONS = [
    ("sglang", dict(tensors=lambda t: prefix_keys(t, "draft_model.")), "silently drop"),
    (
        "sglang",
        dict(config=lambda c: c["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")),
        "aux layer ids missing",
    ),
    (
        "sglang",
        dict(config=lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 5])),
        r"aux layer ids \[2, 4, 5\] != \[1, 3, 4\]",
    ),
    (
        "vllm",
        dict(config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 4])),
        r"aux layer ids \[1, 3, 4\] != \[2, 4, 5\]",
    ),
    ("sglang", dict(tensors=absolute_d2t), r"absolute target ids|i \+ d2t\[i\] leaves"),
    ("vllm", dict(tensors=absolute_d2t), r"absolute target ids|i \+ d2t\[i\] leaves"),
    ("sglang", dict(tensors=zero_fc), "fc.weight is constant"),
    ("sglang", dict(tensors=single_layer_fc), "fc.weight takes 64 inputs, expected n_aux x hidden = 3 x 64"),
    ("sglang", dict(config=lambda c: c.pop("draft_vocab_size")), "draft_vocab_size missing"),
    ("sglang", dict(tensors=nan_norm), "non-finite"),
    ("vllm", dict(tensors=lambda t: prefix_keys(t, "draft_model.")), "raises on unknown names"),
]


@pytest.mark.parametrize("engine,mutation,message", MUTATIONS, ids=[f"{e}-{m}" for e, _, m in MUTATIONS])
def test_each_injected_failure_is_caught(exported, mutate, tmp_path, engine, mutation, message):
    run_dir, facts = exported
    problems = check_export(mutate(run_dir / "export" / engine, tmp_path / engine, **mutation), engine, facts)
    assert any(re.search(message, p) for p in problems), problems


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_engine_own_class_loads_the_export_completely(exported, engine):
    run_dir, facts = exported
    manifest = json.loads((run_dir / "export" / engine / "export_manifest.json").read_text())
    version, cls = {
        "sglang": ("0.5.23", "LlamaForCausalLMEagle3"),
        "vllm": ("0.33.0", "Eagle3LlamaForCausalLM"),
    }[engine]
    assert manifest["verified_by"] == {"engine": engine, "engine_version": version, "class": cls}
    report = engine_report(run_dir / "export" / engine, engine, facts["target_path"])
    assert report["dropped"] == [] and report["unwritten"] == [] and report["partly_written"] == []
    assert report["hot_token_id_ok"] is True and report["errors"] == []
    assert report["aux_layer_ids_read"] == ([1, 3, 4] if engine == "sglang" else [2, 4, 5])
    q = "midlayer.self_attn.q_proj.weight" if engine == "sglang" else "layers.0.self_attn.q_proj.weight"
    assert "lm_head.weight" in report["consumed"] and q in report["consumed"]
    assert report["parameters"]["model.fc.weight"] == [64, 192]
    assert engine_problems(report, report["aux_layer_ids_read"]) == []


def test_the_engine_loads_the_same_export_bytes_once_and_any_other_bytes_again(
    exported, cache_dir, tmp_path, monkeypatch, caplog
):
    """export remembered the engine's report (cache_dir/engine_reports/); a copy of the export elsewhere is
    answered from it without starting the engine; a byte of a weight, or the target's config, changed: the
    engine is started again. Our manifest and serve.sh are not read by the engine and do not count."""
    run_dir, facts = exported
    target, python = facts["target_path"], str(ENGINES_PYTHON)
    copy = shutil.copytree(run_dir / "export" / "sglang", tmp_path / "sglang")
    key = report_key(copy, "sglang", target, python, "EAGLE3")
    assert engine_memo.read(cache_dir, key) is not None  # written by the export stage

    def no_engine(cmd, *a, **kw):
        raise AssertionError(f"the engine was started: {cmd}")

    monkeypatch.setattr(subprocess, "run", no_engine)
    with caplog.at_level(logging.INFO, logger="pipeline.engines.verify"):
        report = engine_report(copy, "sglang", target, python, memo=cache_dir)
    assert report["class"] == "LlamaForCausalLMEagle3" and report["dropped"] == []
    assert "the engine's report of 20" in caplog.text and "on the same bytes" in caplog.text

    (copy / "serve.sh").write_text("#!/bin/sh\n")
    (copy / "export_manifest.json").write_text("{}")
    assert report_key(copy, "sglang", target, python, "EAGLE3") == key
    assert report_key(copy, "sglang", target, python, "EAGLE") != key  # another algorithm asked about
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[-1] ^= 1  # the last byte of the last tensor
    (copy / "model.safetensors").write_bytes(bytes(weights))
    assert report_key(copy, "sglang", target, python, "EAGLE3") != key
    with pytest.raises(AssertionError, match="the engine was started"):
        engine_report(copy, "sglang", target, python, memo=cache_dir)
    other = shutil.copytree(target, tmp_path / "target", ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5 + config["rms_norm_eps"]}))
    copy2 = shutil.copytree(run_dir / "export" / "sglang", tmp_path / "sglang2")
    assert report_key(copy2, "sglang", str(other), python, "EAGLE3") != key


@pytest.mark.parametrize(
    "engine,mutation,message",
    [
        ("sglang", dict(tensors=lambda t: prefix_keys(t, "draft_model.")), "silently dropped 13 tensors"),
        ("sglang", dict(tensors=single_layer_fc), "raised while loading"),
        ("vllm", dict(tensors=lambda t: prefix_keys(t, "draft_model.")), "raised while loading"),
        ("vllm", dict(tensors=absolute_d2t), "draft->target ids"),
    ],
    ids=[
        "sglang-draft_model-prefix",
        "sglang-single-layer-fc",
        "vllm-draft_model-prefix",
        "vllm-absolute-d2t",
    ],
)
def test_engine_own_class_catches_injected_failures(exported, mutate, tmp_path, engine, mutation, message):
    run_dir, facts = exported
    report = engine_report(
        mutate(run_dir / "export" / engine, tmp_path / engine, **mutation), engine, facts["target_path"]
    )
    problems = engine_problems(report)
    assert any(message in p for p in problems), problems


def test_serve_sh_of_a_run_dir_with_a_space_keeps_each_path_one_argument_quoted(exported, make_cfg, tmp_path):
    """#35: every path in serve.sh is shell-quoted, in both engines. bash parses each script, then runs it
    with the engines' programs (`python`, `vllm`) replaced by one that prints its arguments, one per line."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    from pipeline.runner import run_stages

    src, _ = exported
    run_dir = tmp_path / "my runs" / "run 1"
    shutil.copytree(src, run_dir, ignore=lambda d, names: ["export", "eval"] if Path(d) == src else [])
    cfg = ["+experiment=tiny", "data.limit=16", "train.max_steps=4", "export.verify_in_engine=false"]
    run_stages(make_cfg(*cfg, "stage=export", run_dir=run_dir))
    stub = tmp_path / "bin"
    stub.mkdir()
    for program in ("python", "vllm"):
        (stub / program).write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
        (stub / program).chmod(0o755)
    for engine in ("sglang", "vllm"):
        script, draft = run_dir / "export" / engine / "serve.sh", str(run_dir / "export" / engine)
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
        r = subprocess.run(
            ["bash", str(script)],
            env={**os.environ, "PATH": f"{stub}:{os.environ['PATH']}"},
            capture_output=True,
            text=True,
        )
        argv = r.stdout.splitlines()
        assert r.returncode == 0 and argv, r.stderr
        if engine == "sglang":
            assert argv[argv.index("--speculative-draft-model-path") + 1] == draft, argv
        else:
            assert json.loads(argv[argv.index("--speculative-config") + 1])["model"] == draft, argv
