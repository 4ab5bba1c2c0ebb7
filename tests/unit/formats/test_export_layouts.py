import pytest
import torch

from pipeline.formats import export_layouts as lay
from pipeline.formats import sglang_params as sgl_params


def test_engine_layer_numbering():
    assert lay.sglang_layer_ids([1, 14, 26]) == [1, 14, 26]
    assert lay.vllm_layer_ids([1, 14, 26]) == [2, 15, 27]


def test_sglang_deepseek_classes_number_aux_ids_by_their_first_element():
    for arch in ("DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"):
        assert lay.sglang_layer_ids([1, 29, 57], arch) == [1, 29, 57]  # first id 1: read as Llama's
        assert lay.sglang_layer_ids([2, 29, 57], arch) == [3, 30, 58]  # otherwise as "before these layers"
        for ours in ([1, 29, 57], [2, 29, 57], [5]):  # the class's own reading gives back our layers' outputs
            assert lay.sglang_capture_points(lay.sglang_layer_ids(ours, arch), arch) == [k + 1 for k in ours]
    assert lay.sglang_layer_ids([2, 29, 57], "LlamaForCausalLM") == [2, 29, 57]
    assert lay.engine_layer_ids("vllm", [2, 29, 57], "DeepseekV3ForCausalLM") == [3, 30, 58]
    with pytest.raises(lay.AuxIdsUnservable, match="start the aux layers at 1"):
        lay.engine_layer_ids("sglang", [0, 29, 57], "DeepseekV3ForCausalLM")


def test_sglang_replay_fuses_stacked_shards_and_reports_unwritten_params():
    s = sgl_params.Shape(
        hidden=8,
        target_hidden=8,
        n_aux=3,
        heads=2,
        kv_heads=1,
        head_dim=4,
        intermediate=16,
        vocab=32,
        draft_vocab=4,
    )
    table = sgl_params.sglang_param_table(s)
    tensors = {
        "midlayer.self_attn.q_proj.weight": torch.zeros(8, 16),
        "midlayer.self_attn.k_proj.weight": torch.zeros(4, 16),
        "midlayer.self_attn.v_proj.weight": torch.zeros(4, 16),
        "fc.weight": torch.zeros(8, 24),
        "d2t": torch.zeros(4, dtype=torch.long),
        "draft_model.norm.weight": torch.zeros(8),
    }
    r = sgl_params.sglang_load_report(tensors, table)
    assert r["dropped"] == ["draft_model.norm.weight"] and r["shape_problems"] == []
    assert "model.norm.weight" in r["unwritten"] and "model.embed_tokens.weight" not in r["unwritten"]
    assert r["hot_token_id"].tolist() == [0, 1, 2, 3]


MLA = sgl_params.MLAShape(
    hidden=8,
    target_hidden=8,
    n_aux=3,
    heads=2,
    q_lora=4,
    kv_lora=16,
    rope=4,
    nope=4,
    v=4,
    intermediate=16,
    vocab=32,
    draft_vocab=4,
)


def _mla_tensors():
    p = "midlayer.self_attn."
    return {
        p + "q_a_proj.weight": torch.zeros(4, 16),
        p + "kv_a_proj_with_mqa.weight": torch.zeros(20, 16),
        p + "q_a_layernorm.weight": torch.zeros(4),
        p + "q_b_proj.weight": torch.zeros(16, 4),
        p + "kv_a_layernorm.weight": torch.zeros(16),
        p + "kv_b_proj.weight": torch.zeros(16, 16),
        p + "o_proj.weight": torch.zeros(8, 8),
        "midlayer.mlp.gate_proj.weight": torch.zeros(16, 8),
        "midlayer.mlp.up_proj.weight": torch.zeros(16, 8),
        "midlayer.mlp.down_proj.weight": torch.zeros(8, 16),
        **{
            f"midlayer.{n}.weight": torch.zeros(8)
            for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")
        },
        "fc.weight": torch.zeros(8, 24),
        "norm.weight": torch.zeros(8),
        "lm_head.weight": torch.zeros(4, 8),
        "d2t": torch.zeros(4, dtype=torch.long),
        "t2d": torch.zeros(32, dtype=torch.bool),
    }


def test_sglang_mla_replay_fuses_the_two_down_projections_only_when_both_come():
    table = sgl_params.sglang_mla_param_table(MLA)
    good = sgl_params.sglang_mla_load_report(_mla_tensors(), table)
    assert good["dropped"] == good["unwritten"] == good["shape_problems"] == []
    # the layers.0.* spelling is this class's own (it maps it to midlayer.*): consumed the same
    renamed = {
        ("layers.0." + k[9:] if k.startswith("midlayer.") else k): v for k, v in _mla_tensors().items()
    }
    assert sgl_params.sglang_mla_load_report(renamed, table)["unwritten"] == []
    lone = _mla_tensors()
    lone.pop("midlayer.self_attn.kv_a_proj_with_mqa.weight")  # q_a waits for a partner that never comes
    r = sgl_params.sglang_mla_load_report(lone, table)
    assert r["dropped"] == ["midlayer.self_attn.q_a_proj.weight"]
    assert r["unwritten"] == ["model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight"]
    wide = _mla_tensors()
    wide["midlayer.self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(20, 8)  # a 1H input: not EAGLE-3's 2H
    assert sgl_params.sglang_mla_load_report(wide, table)["shape_problems"]


def test_draft_kv_bytes_per_token_mla_latent_vs_gqa_heads():
    kimi_like = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
    }
    llama = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 4096,
        "num_attention_heads": 32,
    }
    assert lay.draft_kv_bytes_per_token(kimi_like) == 1152 and lay.draft_kv_bytes_per_token(llama) == 4096


def test_tensor_table_reports_std_and_norm_not_mean():
    w = torch.tensor([1.0, -1.0]).repeat(50).bfloat16()  # mean 0, clearly loaded
    (row,) = lay.tensor_table({"w": w})
    assert row["std"] > 0.9 and row["norm"] == 10.0 and not lay.is_dead(row)
    (dead,) = lay.tensor_table({"fc.weight": torch.zeros(4, 4)})
    assert lay.is_dead(dead)


def test_draft_owned_leaves_out_exactly_the_target_owned_tensors():
    tensors = {
        k: torch.zeros(1)
        for k in (
            "embed_tokens.weight",
            "verifier_lm_head.weight",
            "verifier_norm.weight",
            "lm_head.weight",
            "fc.weight",
            "layers.0.mlp.up_proj.weight",
            "d2t",
        )
    }
    assert sorted(lay.draft_owned(tensors)) == [
        "d2t",
        "fc.weight",
        "layers.0.mlp.up_proj.weight",
        "lm_head.weight",
    ]
