"""Contract tests of extract.backend=sglang against SGLang 0.5.23's REAL classes, on CPU.

They run inside .venv-engines (tests/integration/test_sglang_capture.py launches them there with
`--noconftest`; in the main venv, without sglang, this module is skipped). No fake SGLang object: the
target class, its layer-capture method, RMSNorm, Req and the registry are SGLang's own. What needs a GPU
(SGLang's ModelRunner forward) is only `sglang_capture.forward_capture`; README shows the GPU command.
"""

import os

import pytest

from pipeline.engines import shims

shims.install()  # before sglang: 0.5.17 imports torchvision from `import sglang` itself
sglang = pytest.importorskip("sglang")

import torch  # noqa: E402

from pipeline.engines import sglang_capture as sc  # noqa: E402
from pipeline.formats import export_layouts as lay  # noqa: E402


@pytest.fixture(scope="module")
def target_dir():
    path = os.environ.get("EAGLEPIPE_CONTRACT_TARGET")
    assert path, "set EAGLEPIPE_CONTRACT_TARGET to a built HF target folder (the tiny Llama)"
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    return sc.build_target_on_meta(target_dir)


def test_the_installed_sglang_is_a_release_the_capture_code_supports():
    assert sc.version_problem(sglang.__version__) is None
    assert "supports sglang 0.5.17 .. 0.5.23, this Python has 0.5.24" in sc.version_problem("0.5.24")
    assert sc.version_problem("0.5.16") and sc.version_problem("0.4.9")


def test_our_aux_ids_make_sglang_capture_the_outputs_of_the_same_layers(target):
    assert type(target).__name__ == "LlamaForCausalLM" and len(target.model.layers) == 8
    target.set_eagle3_layers_to_capture(lay.sglang_layer_ids([1, 3, 4], type(target).__name__))
    # SGLang captures the residual stream ENTERING layer k+1 = the output of layer k = our id k
    assert target.model.layers_to_capture == [2, 4, 5] and target.capture_aux_hidden_states is True


def test_without_ids_sglang_would_capture_its_default_layers(target):
    target.set_eagle3_layers_to_capture(None)
    L = len(target.model.layers)
    assert target.model.layers_to_capture == [2, L // 2, L - 3]  # = our default [1, L//2-1, L-4], entering +1


def test_the_last_state_hook_keeps_the_pre_norm_residual_of_sglangs_own_final_norm(target):
    from sglang.srt.layers.layernorm import RMSNorm

    assert isinstance(target.model.norm, RMSNorm)
    norm = RMSNorm(16, eps=1e-6)
    hook = sc.LastStateHook(norm)
    hidden, residual = torch.randn(5, 16), torch.randn(5, 16)
    normed, _ = norm(hidden, residual)  # SGLang's fused add + norm
    assert torch.equal(hook.last, hidden + residual) and not torch.allclose(normed, hook.last)
    norm(torch.ones(2, 16))  # no residual: the input itself
    assert torch.equal(hook.last, torch.ones(2, 16))


def test_classes_that_capture_are_read_from_sglangs_source():
    names = sc.capturing_classes()
    for cls in (
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "DeepseekV2ForCausalLM",
        "KimiK25ForConditionalGeneration",
    ):
        assert cls in names
    assert "GPT2LMHeadModel" not in names


def test_a_target_class_without_capture_fails_early_naming_those_that_have_it():
    with pytest.raises(
        sc.CaptureUnsupported, match="GPT2LMHeadModel.*no set_eagle3_layers_to_capture.*LlamaForCausalLM"
    ):
        sc.target_class("GPT2LMHeadModel")
    assert sc.target_class("DeepseekV3ForCausalLM")  # inherits the method from DeepseekV2ForCausalLM


def test_a_target_class_read_from_its_one_module_is_the_class_sglangs_registry_maps():
    """target_class imports only the module defining the architecture (the registry imports them all): for
    every class that captures, and a few that do not, the same class object the registry resolves."""
    archs = [*sc.capturing_classes(), "GPT2LMHeadModel", "DeepseekV3ForCausalLM", "Qwen2ForCausalLM"]
    direct = {a: sc._entry_class(a) for a in archs}
    assert direct["LlamaForCausalLM"] is not None and direct["GPT2LMHeadModel"] is not None
    from sglang.srt.models.registry import ModelRegistry

    compared = 0
    for arch, cls in direct.items():
        # None: the registry answers (a class defined in another module than its entry); an architecture whose
        # module the registry could not import here (MindSpore's) it does not map at all
        if cls is not None and arch in ModelRegistry.models:
            assert cls is ModelRegistry.resolve_model_cls([arch])[0], arch
            compared += 1
    assert compared >= 10, compared
    assert sc._entry_class("NoSuchArchitecture") is None


def test_requests_are_prefill_only_with_hidden_states(target_dir):
    from sglang.srt.managers.schedule_batch import Req

    reqs = sc.make_reqs([[5, 6, 7], [8, 9]], first_rid=10)
    assert all(isinstance(r, Req) for r in reqs) and [r.rid for r in reqs] == ["eaglepipe-10", "eaglepipe-11"]
    assert list(reqs[0].origin_input_ids) == [5, 6, 7] and reqs[1].sampling_params.max_new_tokens == 0
    assert reqs[0].return_hidden_states
    prefix = (
        reqs[0].prefix_len if hasattr(reqs[0], "prefix_len") else reqs[0].extend_range.start
    )  # 0.5.23 / 0.5.17
    assert list(reqs[0].get_fill_ids()) == [5, 6, 7] and prefix == 0  # ready for prepare_for_extend


def test_server_args_for_capture(target_dir):
    args = sc.server_args(target_dir, tp_size=1, device="cpu")
    assert args.disable_radix_cache and args.disable_cuda_graph and args.skip_tokenizer_init


def test_our_requests_make_a_batch_that_sglang_prepares_for_extend_with_its_own_pools(target_dir, target):
    """Everything forward_capture does before runner.forward, with SGLang's own pools and cache on CPU."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    config = ModelConfig.from_server_args(sc.server_args(target_dir, 1, "cpu"))
    req_to_token = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(
        size=512,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=16,
        layer_num=8,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = TokenToKVPoolAllocator(512, torch.bfloat16, "cpu", kv, need_sort=False)
    cache = sc.disabled_prefix_cache(req_to_token, allocator)
    batch = sc.extend_batch(sc.make_reqs([[5, 6, 7], [8, 9]]), req_to_token, allocator, cache, config)
    assert batch.forward_mode == ForwardMode.EXTEND and batch.extend_lens == [3, 2]
    assert batch.seq_lens.tolist() == [3, 2] and len(batch.out_cache_loc) == 5  # one KV slot per token
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 9]  # on the batch's device, as the forward reads them
    assert batch.prefix_lens == [0, 0]  # nothing shared: each sample is computed whole
