"""Load an export into SGLang's OWN `LlamaForCausalLMEagle3` through its OWN `load_weights`, on CPU.

Runs inside the sglang virtualenv (.venv-sglang: sglang 0.5.23, torch 2.14.1, transformers 5.19), never in
the main one:   .venv-sglang/bin/python -m pipeline.engines.sglang_verify EXPORT_DIR
Prints one JSON line: the engine version, tensors the loader consumed and dropped, engine parameters
never written, and whether hot_token_id == arange + d2t. Imports nothing else of eaglepipe but the shims.
"""

import json
import socket
import sys

import torch
from safetensors.torch import load_file


def build(export_dir: str):
    from sglang.srt import runtime_context as rc
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.server_args import ServerArgs
    from transformers import LlamaConfig

    rc.publish(ServerArgs(model_path=export_dir, device="cpu"), role="scheduler", ranks=rc.SpawnRanks(world_rank=0))
    with socket.socket() as s:  # a free port for the single-process gloo world
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                    local_rank=0, backend="gloo")
    ps.initialize_model_parallel()
    return LlamaForCausalLMEagle3(LlamaConfig.from_pretrained(export_dir))


def verify(export_dir: str) -> dict:
    import sglang
    import sglang.srt.models.llama_eagle3 as eagle3_module

    model = build(export_dir)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))  # poisoned: a parameter still NaN after loading was never written
    consumed: set[int] = set()

    def recording(loader):
        def wrapped(param, loaded_weight, *args, **kwargs):
            consumed.add(id(loaded_weight))
            return loader(param, loaded_weight, *args, **kwargs)
        return wrapped

    eagle3_module.default_weight_loader = recording(eagle3_module.default_weight_loader)
    for p in params.values():
        if hasattr(p, "weight_loader"):
            p.weight_loader = recording(p.weight_loader)
    tensors = load_file(f"{export_dir}/model.safetensors")
    errors = []
    try:
        model.load_weights(list(tensors.items()))
    except Exception as e:  # a shape mismatch inside the engine's loader
        errors.append(f"{type(e).__name__}: {e}")
    special = {"d2t", "t2d"}  # d2t becomes hot_token_id; t2d is skipped by design
    dropped = sorted(k for k, v in tensors.items() if id(v) not in consumed and k not in special)
    from_target = {"model.embed_tokens.weight"}  # EAGLE3: set_embed(target embedding)
    unwritten = sorted(n for n, p in params.items() if n not in from_target and bool(torch.isnan(p).all()))
    partly = sorted(n for n, p in params.items() if n not in from_target and bool(torch.isnan(p).any())
                    and n not in unwritten)
    hot_ok = None
    if "d2t" in tensors:
        hot = getattr(model, "hot_token_id", None)
        hot_ok = hot is not None and torch.equal(hot, tensors["d2t"] + torch.arange(len(tensors["d2t"])))
    return {"engine": "sglang", "engine_version": sglang.__version__, "class": "LlamaForCausalLMEagle3",
            "consumed": sorted(k for k, v in tensors.items() if id(v) in consumed), "dropped": dropped,
            "unwritten": unwritten, "partly_written": partly, "hot_token_id_ok": hot_ok, "errors": errors,
            "parameters": {n: list(p.shape) for n, p in params.items()}}


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    from pipeline.engines import shims

    shims.install()
    print(json.dumps(verify(sys.argv[1])))
