"""Load an export into SGLang's OWN draft class (`LlamaForCausalLMEagle3`, or `Eagle3DeepseekV2ForCausalLM`
for the MLA draft: the one its config.json names) through its OWN `load_weights`, on CPU.

Runs inside the engines' virtualenv (.venv-engines: sglang 0.5.23 on CPU torch 2.13.0, transformers 5.19),
never in the main one:   .venv-engines/bin/python -m pipeline.engines.sglang_verify EXPORT_DIR TARGET_DIR
[ALGORITHM] Prints one JSON line: the engine version; tensors the loader consumed and dropped; engine
parameters never written; whether hot_token_id == arange + d2t; and what SGLang's own server-side resolution
(`resolve_spec_aux_hidden_state_config`) makes of this draft under ALGORITHM (default EAGLE3): whether the
target captures aux hidden states and which layer ids it passes to `set_eagle3_layers_to_capture`; and what
the target's own class (built on meta) sets `layers_to_capture` to from those ids.
"""

import json
import sys

import torch


def publish(export_dir: str, target_dir: str, algorithm: str):
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=target_dir,
        device="cpu",
        speculative_algorithm=algorithm,
        speculative_draft_model_path=export_dir,
    )
    # 0.5.23 publishes the spawn ranks with the args; 0.5.17 has no SpawnRanks (one process: rank 0 either
    # way)
    ranks = {"ranks": rc.SpawnRanks(world_rank=0)} if hasattr(rc, "SpawnRanks") else {}
    rc.publish(args, role="scheduler", **ranks)
    return args


# The SGLang class of each draft layout (export_layouts.DRAFT_ARCHS names them; read here from config.json, as
# SGLang's model registry does): its module and the config class SGLang parses the export's config.json with.
CLASSES = {
    "LlamaForCausalLMEagle3": ("sglang.srt.models.llama_eagle3", "LlamaConfig"),
    "Eagle3DeepseekV2ForCausalLM": ("sglang.srt.models.kimi_k25_eagle3", "DeepseekV3Config"),
}


def build(export_dir: str):
    """(the export's SGLang class built from its config.json, that class's module)."""
    import importlib

    import transformers
    from sglang.srt.distributed import parallel_state as ps

    from pipeline.engines.loader_audit import single_process_world

    arch = (json.loads(open(f"{export_dir}/config.json").read()).get("architectures") or ["?"])[0]
    module_name, config_class = CLASSES.get(arch, CLASSES["LlamaForCausalLMEagle3"])
    module = importlib.import_module(module_name)
    single_process_world(ps)
    config = getattr(transformers, config_class).from_pretrained(export_dir)
    return getattr(module, arch if arch in CLASSES else "LlamaForCausalLMEagle3")(config), module


def serving_resolution(args, algorithm: str) -> dict:
    """SGLang's own decision, at server start, about capturing aux hidden states for this draft."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    resolved = resolve_spec_aux_hidden_state_config(
        server_args=args,
        model_config=ModelConfig.from_server_args(args),
        spec_algorithm=SpeculativeAlgorithm.from_string(algorithm),
        is_draft_worker=False,
    )
    return {
        "algorithm": algorithm,
        "captures_aux_hidden_states": bool(resolved.eagle_use_aux_hidden_state),
        "aux_layer_ids_read": resolved.eagle_aux_hidden_state_layer_ids,
    }


def target_capture(args, aux_ids_read) -> dict:
    """What the TARGET's own SGLang class makes of the ids the draft config hands it: built on the meta
    device,
    `set_eagle3_layers_to_capture(ids)` called as the EAGLE3 worker calls it; its `layers_to_capture` (the
    loop indices whose input it captures) reported. DeepSeek-V3/Kimi classes number ids differently from
    Llama's."""
    from pipeline.engines.sglang_capture import decoder_of, target_on_meta

    target = target_on_meta(args)
    target.set_eagle3_layers_to_capture(aux_ids_read)
    return {
        "target_class": type(target).__name__,
        "target_layers_to_capture": [int(i) for i in decoder_of(target).layers_to_capture],
    }


def verify(export_dir: str, target_dir: str, algorithm: str = "EAGLE3") -> dict:
    import sglang

    from pipeline.engines.loader_audit import LoaderAudit

    args = publish(export_dir, target_dir, algorithm)
    serving = serving_resolution(args, algorithm)
    model, eagle3_module = build(export_dir)
    audit = LoaderAudit(model)
    # load_weights takes getattr(param, "weight_loader", default_weight_loader) for every parameter
    tensors, errors = audit.load(f"{export_dir}/model.safetensors", eagle3_module.default_weight_loader)
    # d2t becomes hot_token_id; t2d is skipped by design; the embedding is the target's (set_embed, EAGLE3)
    report = audit.report(
        tensors, not_loaded_by_design={"d2t", "t2d"}, from_target={"model.embed_tokens.weight"}, errors=errors
    )
    hot_ok = None
    if "d2t" not in tensors:  # a full-vocabulary draft: draft id = target id, so no hot_token_id, and the
        # draft's logits (its LogitsProcessor, over config.draft_vocab_size) span the target's vocabulary
        from sglang.srt.configs.model_config import ModelConfig

        target_vocab = ModelConfig.from_server_args(args).vocab_size
        hot_ok = model.hot_token_id is None and model.logits_processor.vocab_size == target_vocab
    else:
        hot = getattr(model, "hot_token_id", None)
        hot_ok = hot is not None and torch.equal(hot, tensors["d2t"] + torch.arange(len(tensors["d2t"])))
        if hot_ok and "t2d" in tensors:
            hot_ok = bool(hot.max() < len(tensors["t2d"])) and torch.equal(
                hot, torch.nonzero(tensors["t2d"]).flatten()
            )
    capture = (
        target_capture(args, serving["aux_layer_ids_read"]) if serving["captures_aux_hidden_states"] else {}
    )
    return {
        "engine": "sglang",
        "engine_version": sglang.__version__,
        "class": type(model).__name__,
        "hot_token_id_ok": hot_ok,
        **serving,
        **capture,
        **report,
    }


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    from pipeline.engines import shims
    from pipeline.lazy_compile import compile_deferred

    shims.install()
    with compile_deferred():  # SGLang's modules call torch.compile as they are imported; verify runs none
        report = verify(*sys.argv[1:4])
    print(json.dumps(report))
