"""verify.check_export, the engine-free checks: a good export of each layout passes, and each rule fires on
an export broken in exactly that way (tiny synthetic tensors, no model, no engine)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from pipeline.engines.verify import check_export

H, HEADS, KV, HEAD_DIM, INTER, V, DRAFT_V = 8, 2, 1, 4, 16, 32, 8
AUX = [1, 4, 6]
FACTS = {"hidden_size": H, "vocab_size": V, "aux_layer_ids": AUX}
USED = [0, 2, 3, 7, 11, 12, 20, 31]  # the target ids of the draft vocabulary


def speculators_tensors() -> dict:
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g)

    q, kv = HEADS * HEAD_DIM, KV * HEAD_DIM
    layer = {
        "self_attn.q_proj.weight": w(q, 2 * H),
        "self_attn.k_proj.weight": w(kv, 2 * H),
        "self_attn.v_proj.weight": w(kv, 2 * H),
        "self_attn.o_proj.weight": w(H, q),
        "mlp.gate_proj.weight": w(INTER, H),
        "mlp.up_proj.weight": w(INTER, H),
        "mlp.down_proj.weight": w(H, INTER),
        "input_layernorm.weight": torch.ones(H),
        "hidden_norm.weight": torch.ones(H),
        "post_attention_layernorm.weight": torch.ones(H),
    }
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[USED] = True
    return {
        **{f"layers.0.{k}": v for k, v in layer.items()},
        "fc.weight": w(H, len(AUX) * H),
        "norm.weight": torch.ones(H),
        "lm_head.weight": w(DRAFT_V, H),
        "d2t": torch.tensor(USED) - torch.arange(DRAFT_V),
        "t2d": t2d,
    }


def good(engine: str) -> tuple[dict, dict]:
    tensors = speculators_tensors()
    shape = {
        "hidden_size": H,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTER,
        "draft_vocab_size": DRAFT_V,
    }
    if engine == "sglang":
        tensors = {
            ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
            for k, v in tensors.items()
        }
        config = {
            "architectures": ["LlamaForCausalLMEagle3"],
            **shape,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX), "use_aux_hidden_state": True},
        }
    else:
        config = {
            "architectures": ["Eagle3Speculator"],
            **shape,
            "eagle_aux_hidden_state_layer_ids": [k + 1 for k in AUX],
        }
    return tensors, config


def write(folder, tensors, config):
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def problems_of(tmp_path, engine, edit_tensors=None, edit_config=None):
    tensors, config = good(engine)
    if edit_tensors:
        edited = edit_tensors(tensors)
        tensors = tensors if edited is None else edited
    if edit_config:
        edit_config(config)
    return check_export(write(tmp_path / engine, tensors, config), engine, FACTS)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_good_export_has_no_problem(tmp_path, engine):
    assert problems_of(tmp_path, engine) == []


def aux_ids(config, ids):
    if "eagle_config" in config:
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    else:
        config["eagle_aux_hidden_state_layer_ids"] = ids


def drop(d, key):
    del d[key]


def set_(d, key, value):
    d[key] = value


def scaled(t, key, value):
    t[key] = torch.full_like(t[key], value)


def nan_at(t, key):
    t[key] = t[key].clone()
    t[key][0] = float("nan")


BOTH = [
    ("aux ids missing", None, lambda c: aux_ids(c, None), "aux layer ids missing from config.json"),
    ("aux ids in the other numbering", None, lambda c: aux_ids(c, [2, 3, 4]), "aux layer ids [2, 3, 4] != "),
    ("fc missing", lambda t: drop(t, "fc.weight"), None, "fc.weight missing"),
    (
        "fc of one layer",
        lambda t: set_(t, "fc.weight", t["fc.weight"][:, :H].contiguous()),
        None,
        f"fc.weight takes {H} inputs, expected n_aux x hidden = 3 x {H}",
    ),
    ("no d2t", lambda t: drop(t, "d2t"), None, "d2t/t2d missing"),
    (
        "absolute d2t",
        lambda t: set_(t, "d2t", torch.tensor(USED)),
        None,
        "vocab: d2t holds absolute target ids",
    ),
    (
        "draft vocab size differs",
        None,
        lambda c: set_(c, "draft_vocab_size", DRAFT_V + 1),
        "vocab: len(d2t)=8 != draft vocab 9",
    ),
    ("a NaN", lambda t: nan_at(t, "norm.weight"), None, "norm.weight has non-finite values"),
    ("a zeroed fc", lambda t: scaled(t, "fc.weight", 0.0), None, "fc.weight is constant (std 0, norm 0)"),
    (
        "a constant lm_head",
        lambda t: scaled(t, "lm_head.weight", 0.5),
        None,
        "lm_head.weight is constant (std 0, norm 4):",
    ),
]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("what,tensors,config,message", BOTH, ids=[b[0] for b in BOTH])
def test_each_rule_of_both_layouts_fires_on_its_own_breakage(
    tmp_path, engine, what, tensors, config, message
):
    problems = problems_of(tmp_path, engine, tensors, config)
    assert any(message in p for p in problems), problems


def test_vllm_numbering_is_ours_plus_one(tmp_path):
    problems = problems_of(tmp_path, "vllm", edit_config=lambda c: aux_ids(c, list(AUX)))
    assert problems == ["aux layer ids [1, 4, 6] != [2, 5, 7] (vllm numbering of the store's [1, 4, 6])"]


def sg(t, old, new):
    t[new] = t.pop(old)


def pre_rename(t):
    return {
        ("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in t.items()
    }


SGLANG = [
    (
        "another architecture",
        None,
        lambda c: set_(c, "architectures", ["LlamaForCausalLM"]),
        "architectures ['LlamaForCausalLM'] is none of [['LlamaForCausalLMEagle3'], "
        "['Eagle3DeepseekV2ForCausalLM']]",
    ),
    (
        "no draft_vocab_size",
        None,
        lambda c: c.pop("draft_vocab_size"),
        "draft_vocab_size missing: SGLang would use",
    ),
    ("post-rename names", pre_rename, None, "10 tensors named layers.* (layers.0.hidden_norm.weight, ...)"),
    (
        "a prefixed key",
        lambda t: sg(t, "lm_head.weight", "draft_model.lm_head.weight"),
        None,
        "SGLang 0.5.23 would silently drop ['draft_model.lm_head.weight']",
    ),
    (
        "a layer weight missing",
        lambda t: drop(t, "midlayer.mlp.down_proj.weight"),
        None,
        "SGLang parameters never written: ['model.layers.0.mlp.down_proj.weight']",
    ),
    (
        "a wrong shape",
        lambda t: set_(t, "midlayer.self_attn.o_proj.weight", torch.randn(H, H + 1)),
        None,
        f"model.layers.0.self_attn.o_proj.weight: export gives ({H}, {H + 1}), engine has ({H}, {H})",
    ),
    (
        "a split qkv of the wrong width",
        lambda t: set_(t, "midlayer.self_attn.k_proj.weight", torch.randn(2 * HEAD_DIM, 2 * H)),
        None,
        "model.layers.0.self_attn.qkv_proj.weight: export gives "
        f"({HEADS * HEAD_DIM + 3 * HEAD_DIM}, {2 * H})",
    ),
    (
        "t2d elsewhere than d2t points",
        lambda t: set_(t, "t2d", torch.roll(t["t2d"], 1)),
        None,
        "SGLang's hot_token_id (arange + d2t) does not point at the t2d ids",
    ),
]


@pytest.mark.parametrize("what,tensors,config,message", SGLANG, ids=[s[0] for s in SGLANG])
def test_each_sglang_rule_fires_on_its_own_breakage(tmp_path, what, tensors, config, message):
    problems = problems_of(tmp_path, "sglang", tensors, config)
    assert any(p.startswith(message) for p in problems), problems


def test_vllm_refuses_names_its_loader_does_not_know(tmp_path):
    problems = problems_of(
        tmp_path, "vllm", lambda t: {("draft." + k if k.startswith("fc") else k): v for k, v in t.items()}
    )
    assert "vLLM's eagle3 loader raises on unknown names: ['draft.fc.weight']" in problems
    assert "fc.weight missing" in problems


def test_the_sglang_layout_is_not_a_vllm_export(tmp_path):
    tensors, _ = good("sglang")
    _, config = good("vllm")
    problems = check_export(write(tmp_path / "x", tensors, config), "vllm", FACTS)
    assert problems and problems[0].startswith("vLLM's eagle3 loader raises on unknown names: ['midlayer.")
