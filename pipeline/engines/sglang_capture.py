"""`extract.backend=sglang`: the target's hidden states captured inside SGLang's own ModelRunner.

Runs in a Python that has sglang 0.5.17 .. 0.5.23 (a GPU box; CI's .venv-engines has 0.5.23 for the contract
tests, and they also pass against 0.5.17's source: docs/conventions.md, "SGLang 0.5.17 vs 0.5.23"). The
feature store, sharding, resume and sample order are extract.py's; this module only turns a batch of samples
(token id lists) into packed (aux, last) tensors, like capture.hf.Capture.packed does for HF:
- aux: SGLang's own capture. `set_eagle3_layers_to_capture(ids)` (sglang/srt/models/llama.py) sets
  `model.layers_to_capture = [k + 1 for k in ids]`, i.e. the residual stream entering layer k+1 = the output
  of layer k: SGLang id k = eaglepipe id k (docs/conventions.md). DeepSeek-V2/V3 and Kimi-K2.5 classes number
  by the first id (export_layouts.SGLANG_FIRST_ID_RULE); `request_capture` checks what the class set. With
  `CaptureHiddenMode.FULL` the logits output's `hidden_states` is the concatenation of those states for every
  token.
- last: SGLang does not return it under aux capture (its logits processor hands back the aux concatenation
  instead of the final state), and `return_hidden_states_before_norm` is ignored by llama. So a forward hook
  on the final norm keeps its updated residual: SGLang calls `norm(hidden, residual)`, which returns
  (normed, hidden + residual) (layers/layer_boundary/residual/access.py::final_norm_pair); the second is
  the pre-norm output of the last decoder layer, the state EAGLE-3 trains on.
Route chosen (docs/conventions.md, "SGLang capture"): ModelRunner in-process, not `sglang.Engine` with
`--enable-return-aux-hidden-states`: the Engine route converts every captured state to Python lists on
the scheduler (managers/scheduler_components/batch_result_processor.py::_append_prefill_hidden_states,
`.cpu().clone().tolist()`: 21,504 floats a token for Kimi-K2.5) and returns no last state at all. The
ModelRunner route depends on more SGLang-internal API (ModelRunner, Req, ScheduleBatch, ForwardBatch): only
`build_runner` and the forward in `forward_capture` need a GPU; requests, the prefix cache and the extend
batch (`make_reqs`, `disabled_prefix_cache`, `extend_batch`) are contract-tested on CPU with SGLang's own
pools.
"""

from __future__ import annotations

import ast
from array import array
from pathlib import Path

import torch

from pipeline.formats import export_layouts as lay

SGLANG_VERSION = lay.ENGINES["sglang"].version  # the release CI's contract tests import
SUPPORTED = lay.ENGINES["sglang"].supported  # oldest .. newest release this module ran against


def version_problem(version: str) -> str | None:
    """None if this SGLang release is one the capture code was written and run against, else why not."""
    from packaging.version import Version

    if not Version(SUPPORTED[0]) <= Version(version) <= Version(SUPPORTED[1]):
        return (
            f"extract.backend=sglang supports sglang {SUPPORTED[0]} .. {SUPPORTED[1]}, this Python has "
            f"{version}"
        )
    return None


class CaptureUnsupported(Exception):
    pass


def _model_sources():
    """(module name, source text) of each file of the installed sglang.srt.models, in name order."""
    import importlib.util

    folder = Path(list(importlib.util.find_spec("sglang.srt.models").submodule_search_locations)[0])
    for path in sorted(folder.glob("*.py")):
        yield path.stem, path.read_text(encoding="utf-8-sig")  # 0.5.17 has files with a BOM


def capturing_classes() -> list[str]:
    """SGLang model classes that define set_eagle3_layers_to_capture, read from the installed source."""
    found = set()
    for _, text in _model_sources():
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef) and any(
                isinstance(f, ast.FunctionDef) and f.name == "set_eagle3_layers_to_capture" for f in node.body
            ):
                found.add(node.name)
    return sorted(found)


def _entry_class(architecture: str):
    """SGLang's registered class for `architecture`, from the one module of sglang.srt.models that defines it
    (the class that module lists in EntryClass, as the registry maps it), or None where no module does.
    Importing sglang.srt.models.registry imports every model module SGLang has (~5 s of a 2-core machine)."""
    import importlib
    import re

    defines = re.compile(rf"^class {re.escape(architecture)}\b", re.M)
    for name, text in _model_sources():
        if defines.search(text):
            try:
                module = importlib.import_module(f"sglang.srt.models.{name}")
            except Exception:  # as the registry does: a module that does not import here maps nothing
                return None
            entry = getattr(module, "EntryClass", None)
            entries = entry if isinstance(entry, list) else [entry]
            return next((c for c in entries if getattr(c, "__name__", None) == architecture), None)
    return None


def target_class(architecture: str):
    """SGLang's class for a target architecture; CaptureUnsupported (naming those that can) if it cannot
    capture."""
    cls = _entry_class(architecture)
    if cls is None:  # defined elsewhere, or not at all: the registry's own answer (or its error)
        from sglang.srt.models.registry import ModelRegistry

        cls, _ = ModelRegistry.resolve_model_cls([architecture])
    if not hasattr(cls, "set_eagle3_layers_to_capture"):
        raise CaptureUnsupported(
            f"SGLang {_installed()}'s {cls.__name__} (architecture {architecture}) has no "
            f"set_eagle3_layers_to_capture, so it cannot capture aux hidden states; classes that define it: "
            f"{', '.join(capturing_classes())}. Use extract.backend=hf for this target."
        )
    return cls


def _installed() -> str:
    import sglang

    return sglang.__version__


def server_args(
    target_dir: str,
    tp_size: int = 1,
    device: str = "cuda",
    mem_fraction_static: float = 0.8,
    attention_backend: str | None = None,
):
    """ServerArgs for a capture-only target: no radix cache (every sample is a fresh extend), no CUDA graphs
    (extend batches of varying shape), no tokenizer (we send token ids). attention_backend None = SGLang's
    choice (fa3 on Hopper: a box without FA3, like the H200 bundle, needs "triton")."""
    from sglang.srt.server_args import ServerArgs

    extra = {"attention_backend": attention_backend} if attention_backend else {}
    return ServerArgs(
        model_path=target_dir,
        tp_size=tp_size,
        device=device,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        disable_radix_cache=True,
        disable_cuda_graph=True,
        mem_fraction_static=mem_fraction_static,
        **extra,
    )


def make_reqs(samples: list[list[int]], first_rid: int = 0) -> list:
    """One SGLang Req per sample: prefill only (max_new_tokens=0), hidden states of every position kept."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    reqs = []
    for j, ids in enumerate(samples):
        params = SamplingParams(max_new_tokens=0, temperature=0.0)
        req = Req(
            rid=f"eaglepipe-{first_rid + j}",
            origin_input_text="",
            origin_input_ids=array("q", ids),
            sampling_params=params,
            return_hidden_states=True,
        )
        req.init_next_round_input(None)  # no prefix cache: the whole sample is this extend's input
        n = len(req.full_untruncated_fill_ids)  # non-chunked prefill, as schedule_policy sets it:
        if hasattr(req, "set_extend_range"):
            req.set_extend_range(0, n)  # 0.5.17: extend_range = Range(prefix_len, end)
        else:
            req.extend_end = n  # 0.5.23
        reqs.append(req)
    return reqs


class LastStateHook:
    """Keeps the pre-norm output of the last decoder layer: the residual the final norm returns updated."""

    def __init__(self, norm: torch.nn.Module):
        self.last = None
        self.handle = norm.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        # norm(hidden, residual) -> (normed, hidden + residual); norm(hidden) -> normed (input is the state)
        pre = (
            output[1] if isinstance(output, tuple) and len(output) > 1 and output[1] is not None else args[0]
        )
        self.last = pre.detach().clone()  # SGLang's residual buffer is reused by the next forward

    def remove(self):
        self.handle.remove()


class SGLangCapture:
    """capture.hf.Capture's `packed` over SGLang: samples (lists of token ids) -> (aux [sum(len), n*H],
    last [sum(len), H]) in bf16 on the GPU, sample after sample. SGLang packs a batch token after token
    itself, so nothing is padded: the ids go from the host lists straight into the requests (no padded batch
    on the device,
    no per-row device-to-host `tolist`), and the states come back in the order extract writes them."""

    def __init__(self, runner, aux_ids: list[int]):
        self.runner, self.aux_ids = runner, aux_ids
        model = runner.model
        request_capture(model, aux_ids)
        self.hook = LastStateHook(decoder_of(model).norm)
        self.tree_cache = disabled_prefix_cache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator)
        self.next_rid = 0

    def packed(self, samples: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        reqs = make_reqs(samples, self.next_rid)
        self.next_rid += len(reqs)
        aux, last = forward_capture(self.runner, reqs, self.hook, self.tree_cache)
        total = sum(len(s) for s in samples)
        if aux.shape[0] != total or last.shape[0] != total:
            raise RuntimeError(
                f"SGLang returned {aux.shape[0]}/{last.shape[0]} token states for {total} tokens"
            )
        return aux.to(torch.bfloat16), last.to(torch.bfloat16)

    def remove(self):
        self.hook.remove()


def decoder_of(model):
    """The decoder (the module with `layers` and the final `norm`) of an SGLang causal-LM class: `.model` for
    Llama and DeepSeek-V2/V3; KimiK25ForConditionalGeneration's `.model` is its DeepseekV3 language model, one
    level further."""
    inner = model.model
    return inner if hasattr(inner, "layers") else inner.model


def request_capture(model, aux_ids: list[int]) -> list[int]:
    """Ask the SGLang target class to capture the outputs of our layers `aux_ids`, in its own numbering (which
    depends on the class: export_layouts.SGLANG_FIRST_ID_RULE); check what it set, before any forward."""
    model.set_eagle3_layers_to_capture(lay.sglang_layer_ids(aux_ids, type(model).__name__))
    points = list(decoder_of(model).layers_to_capture)
    if points != [k + 1 for k in aux_ids]:
        raise RuntimeError(
            f"SGLang's {type(model).__name__} set layers_to_capture {points} for our aux layers "
            f"{aux_ids} (it captures the inputs of those layers): the numbering changed, see "
            "export_layouts.SGLANG_FIRST_ID_RULE"
        )
    return points


def publish(args, tp_rank: int = 0, tp_size: int = 1) -> dict:
    """Install SGLang's process-wide config as its scheduler does for this rank. Returns the ModelRunner
    arguments that differ between releases: 0.5.23 publishes the ranks with the args (runtime_context.
    SpawnRanks); 0.5.17 publishes the args alone and hands the runner a ParallelState."""
    from sglang.srt import runtime_context as rc

    if hasattr(rc, "SpawnRanks"):
        rc.publish(args, role="scheduler", ranks=rc.SpawnRanks(world_rank=tp_rank, gpu_id=tp_rank))
        return {}
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState

    rc.publish(args, role="scheduler")
    return {
        "ps": ParallelState.trivial(
            tp_rank=tp_rank, tp_size=tp_size, attn_tp_rank=tp_rank, attn_tp_size=tp_size, gpu_id=tp_rank
        )
    }


def build_runner(
    target_dir: str,
    tp_rank: int,
    tp_size: int,
    nccl_port: int,
    mem_fraction_static: float = 0.8,
    attention_backend: str | None = None,
):
    """SGLang's ModelRunner for the target on this rank's GPU (a torchrun rank = a TP rank). GPU only."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner

    args = server_args(target_dir, tp_size, "cuda", mem_fraction_static, attention_backend)
    per_release = publish(args, tp_rank, tp_size)
    config = ModelConfig.from_server_args(args)
    target_class(config.hf_config.architectures[0])
    runner = ModelRunner(
        model_config=config,
        mem_fraction_static=mem_fraction_static,
        gpu_id=tp_rank,
        nccl_port=nccl_port,
        server_args=args,
        **per_release,
    )
    finish_runner(runner)
    return runner


def finish_runner(runner) -> None:
    """What SGLang's scheduler does after building the ModelRunner (managers/scheduler.py::init_model_worker,
    0.5.17 and 0.5.23 alike): the constructor only loads the weights; the KV pools, the attention backends
    and the phase runners (the eager one; every CUDA graph is off in server_args) come after."""
    if runner.req_to_token_pool is None:
        runner.alloc_memory_pool()
    runner.init_attention_backends()
    runner.init_cuda_graphs()


def disabled_prefix_cache(req_to_token_pool, token_to_kv_pool_allocator):
    """What SGLang's scheduler builds under --disable-radix-cache (mem_cache/registry.py::create_tree_cache ->
    create_unified_radix_cache): a UnifiedRadixCache with disable=True over the FULL component. Batches need
    one (ScheduleBatch consults it while allocating), it never shares a prefix."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    params = CacheInitParams(
        disable=True,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=token_to_kv_pool_allocator,
        page_size=1,
    )
    params.tree_components = (ComponentType.FULL,)
    return UnifiedRadixCache(params)


def extend_batch(reqs: list, req_to_token_pool, token_to_kv_pool_allocator, tree_cache, model_config):
    """A ScheduleBatch of our requests, prepared for one extend (KV slots allocated). Runs on CPU too."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    batch = ScheduleBatch.init_new(
        reqs,
        req_to_token_pool,
        token_to_kv_pool_allocator,
        tree_cache=tree_cache,
        model_config=model_config,
        enable_overlap=False,
        spec_algorithm=SpeculativeAlgorithm.from_string("NONE"),
    )
    batch.prepare_for_extend()
    # prepare_for_extend stages the token ids on the host (prefill_input_ids_cpu, 0.5.17 and 0.5.23) and
    # leaves input_ids None; the scheduler copies them over at forward entry (managers/overlap_utils.py::
    # resolve_forward_inputs, prefill case). Without this the forward gets no input ids: on the H200 the eager
    # runner's buffer copy failed ("size of tensor a (0) must match ... b (23565)", 2026-12-01).
    if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
        batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
        batch.prefill_input_ids_cpu = None
    return batch


def forward_capture(runner, reqs: list, hook: LastStateHook, tree_cache):
    """THE GPU-only part: one extend forward with FULL capture; KV pools cleared after. (aux, last) flat."""
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
    )

    try:
        batch = extend_batch(
            reqs, runner.req_to_token_pool, runner.token_to_kv_pool_allocator, tree_cache, runner.model_config
        )
        forward_batch = ForwardBatch.init_new(
            batch, runner, capture_hidden_mode=CaptureHiddenMode.FULL, return_hidden_states_before_norm=False
        )
        out = runner.forward(forward_batch)
        aux = out.logits_output.hidden_states
        if aux is None or hook.last is None:
            raise RuntimeError(
                "SGLang returned no captured hidden states: aux capture is not enabled on the target"
            )
        return aux, hook.last
    finally:
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()


def build_target_on_meta(target_dir: str):
    """The target's SGLang class built on the meta device in a single-process gloo world (contract tests and
    `eaglepipe verify`-style checks on CPU; no weights, no kernels)."""
    args = server_args(target_dir, 1, "cpu")
    publish(args)
    return target_on_meta(args)


def target_on_meta(args):
    """The target class for these already-published ServerArgs, on meta, in a single-process gloo world."""
    import inspect

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers import dp_attention

    from pipeline.engines.loader_audit import single_process_world

    single_process_world(ps)
    config = ModelConfig.from_server_args(args)
    # 0.5.17's DeepSeek classes read the attention-DP size, set by initialize_dp_attention(server_args,
    # model_config) at start-up (distributed/bootstrap.py); 0.5.23 derives it from the published topology.
    if (
        "model_config" in inspect.signature(dp_attention.initialize_dp_attention).parameters
        and getattr(dp_attention, "_ATTN_DP_SIZE", 1) is None
    ):
        dp_attention.initialize_dp_attention(args, config)
    cls = target_class(config.hf_config.architectures[0])
    with torch.device("meta"):
        return cls(config=config.hf_config, quant_config=None)
