"""Load an export into vLLM's OWN `Eagle3LlamaForCausalLM` through its OWN `load_weights`, on CPU.

Runs inside the engines' virtualenv (.venv-engines: vllm 0.33.0 installed --no-deps beside CPU torch 2.13.0;
`make setup-engines`), never in the main one:
    .venv-engines/bin/python -m pipeline.engines.vllm_verify EXPORT_DIR TARGET_DIR
vLLM's compiled ops (vllm._C) are absent on CPU and only warn; nothing here calls a kernel. The draft is
built the way vLLM's proposer builds it: a `VllmConfig` whose `SpeculativeConfig(method="eagle3",
model=EXPORT_DIR)` reads the export's config.json, a gloo world of 1. Prints one JSON line.
"""

import json
import os
import sys
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402


def build(export_dir: str, target_dir: str):
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import parallel_state as ps

    from pipeline.engines.loader_audit import single_process_world

    target = ModelConfig(model=target_dir, dtype="bfloat16", skip_tokenizer_init=True)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(
        method="eagle3",
        model=export_dir,
        num_speculative_tokens=3,
        target_model_config=target,
        target_parallel_config=parallel,
    )
    config = VllmConfig(
        model_config=target,
        parallel_config=parallel,
        speculative_config=spec,
        device_config=DeviceConfig(device="cpu"),
    )
    ctx = set_current_vllm_config(config)
    ctx.__enter__()  # vLLM's layers read the current config while they are built
    single_process_world(ps)
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    with torch.device("cpu"):
        return Eagle3LlamaForCausalLM(vllm_config=config), spec


def aux_ids_read_by_engine(spec) -> list[int] | None:
    """The ids vLLM's runner passes to the target's set_aux_hidden_state_layers (its own function)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    ids = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))
    return list(ids) if ids else None


def verify(export_dir: str, target_dir: str) -> dict:
    import vllm
    from vllm.model_executor.model_loader import weight_utils

    from pipeline.engines.loader_audit import LoaderAudit

    model, spec = build(export_dir, target_dir)
    audit = LoaderAudit(model)
    # vLLM raises on names it cannot place, and on shape mismatches: an error line of the report
    tensors, errors = audit.load(f"{export_dir}/model.safetensors", weight_utils.default_weight_loader)
    report = audit.report(
        tensors, not_loaded_by_design={"t2d"}, from_target={"model.embed_tokens.weight"}, errors=errors
    )
    mapping_ok = None
    if "d2t" not in tensors:  # a full-vocabulary draft: vLLM's compute_logits maps nothing (draft id = target
        # id) when it built no draft_id_to_target_id (draft_vocab_size == the target's vocabulary), and it
        # asserts that the logits are as wide as the draft config's vocab_size
        c = model.config
        mapping_ok = model.draft_id_to_target_id is None and (
            c.draft_vocab_size == c.vocab_size == spec.target_model_config.get_vocab_size()
        )
    elif "t2d" in tensors and model.draft_id_to_target_id is not None:  # compute_logits: arange + d2t
        targets = torch.arange(len(model.draft_id_to_target_id)) + model.draft_id_to_target_id
        t2d = tensors["t2d"]
        mapping_ok = bool(targets.min() >= 0 and targets.max() < len(t2d)) and torch.equal(
            targets, torch.nonzero(t2d).flatten()
        )
    return {
        "engine": "vllm",
        "engine_version": vllm.__version__,
        "class": type(model).__name__,
        "aux_layer_ids_read": aux_ids_read_by_engine(spec),
        "uses_aux_hidden_states": bool(model.model.use_aux_hidden_state),
        "fc_input_size": int(model.model.fc_input_size) if hasattr(model.model, "fc_input_size") else None,
        "hot_token_id_ok": mapping_ok,
        **report,
    }


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    print(json.dumps(verify(sys.argv[1], sys.argv[2])))
