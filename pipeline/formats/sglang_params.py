"""SGLang's parameter table for an EAGLE-3 draft (the Llama layout and the MLA first layer) and a replay of
its load_weights name mapping over an export's tensors: which tensors SGLang would consume, drop or never
write, without SGLang installed (the engine's own class checks the same with it: pipeline/engines/)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Shape:
    hidden: int
    target_hidden: int
    n_aux: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_vocab: int


def sglang_param_table(s: Shape) -> dict[str, tuple[int, ...]]:
    """Parameters of sglang 0.5.23 LlamaForCausalLMEagle3 (one layer), as its module tree declares them."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    p = "model.layers.0."
    return {
        p + "self_attn.qkv_proj.weight": (q + 2 * kv, 2 * s.hidden),
        p + "self_attn.o_proj.weight": (s.hidden, q),
        **_eagle3_params(p, s),
    }


def _eagle3_params(p: str, s) -> dict[str, tuple[int, ...]]:
    """What every SGLang EAGLE-3 draft class declares beside its attention (`p` = its layer's prefix): the
    embedding, the dense MLP, the three layer norms, fc over the aux states, the final norm, the draft
    lm_head."""
    return {
        "model.embed_tokens.weight": (s.vocab, s.hidden),
        p + "mlp.gate_up_proj.weight": (2 * s.intermediate, s.hidden),
        p + "mlp.down_proj.weight": (s.hidden, s.intermediate),
        p + "input_layernorm.weight": (s.hidden,),
        p + "hidden_norm.weight": (s.hidden,),
        p + "post_attention_layernorm.weight": (s.hidden,),
        "model.fc.weight": (s.hidden, s.n_aux * s.target_hidden),
        "model.norm.weight": (s.hidden,),
        "lm_head.weight": (s.draft_vocab, s.hidden),
    }


@dataclass
class MLAShape:
    hidden: int
    target_hidden: int
    n_aux: int
    heads: int
    q_lora: int
    kv_lora: int
    rope: int
    nope: int
    v: int
    intermediate: int
    vocab: int
    draft_vocab: int


def sglang_mla_param_table(s: MLAShape) -> dict[str, tuple[int, ...]]:
    """Parameters of sglang Eagle3DeepseekV2ForCausalLM (0.5.17 and 0.5.23), as its module tree declares them:
    DeepseekV2AttentionMLA with its q/kv down projections fused into one, widened to the 2H EAGLE-3 input."""
    p = "model.midlayer."
    return {
        p + "self_attn.fused_qkv_a_proj_with_mqa.weight": (s.q_lora + s.kv_lora + s.rope, 2 * s.hidden),
        p + "self_attn.q_a_layernorm.weight": (s.q_lora,),
        p + "self_attn.q_b_proj.weight": (s.heads * (s.nope + s.rope), s.q_lora),
        p + "self_attn.kv_a_layernorm.weight": (s.kv_lora,),
        p + "self_attn.kv_b_proj.weight": (s.heads * (s.nope + s.v), s.kv_lora),
        p + "self_attn.o_proj.weight": (s.hidden, s.heads * s.v),
        **_eagle3_params(p, s),
    }


def sglang_mla_load_report(tensors: dict[str, torch.Tensor], table: dict[str, tuple[int, ...]]) -> dict:
    """Replay Eagle3DeepseekV2ForCausalLM.load_weights' name handling (sglang 0.5.17/0.5.23): `layers.0.` ->
    `midlayer.`, `model.` before all but lm_head; gate/up stacked into gate_up_proj; q_a_proj and
    kv_a_proj_with_mqa held until BOTH have come, then concatenated into fused_qkv_a_proj_with_mqa (one
    without the other is never written, and nothing says so); any other unknown name skipped with a log
    warning
    only."""
    import re

    written: dict[str, list[tuple[int, ...]]] = {}
    dropped, hot_token_id, held = [], None, {}
    for original, w in tensors.items():
        if original == "d2t" or original.endswith(".d2t"):
            hot_token_id = w + torch.arange(w.shape[0])
            continue
        if original == "t2d" or original.endswith(".t2d"):
            continue
        name = re.sub(r"^layers\.0\.", "midlayer.", original)
        name = name if name.startswith("lm_head.") else f"model.{name}"
        stacked = next((name.replace(shard, fused) for fused, shard, _ in MLP_STACKED if shard in name), None)
        if stacked is not None and stacked in table:
            written.setdefault(stacked, []).append(tuple(w.shape))
            continue
        if "q_a_proj" in name or "kv_a_proj_with_mqa" in name:
            q_name = name.replace("kv_a_proj_with_mqa", "q_a_proj")
            held[q_name] = held.get(q_name, []) + [(original, tuple(w.shape))]
            if len(held[q_name]) == 2:
                fused = q_name.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")
                if fused in table:
                    written.setdefault(fused, []).append((sum(sh[0] for _, sh in held[q_name]), *w.shape[1:]))
                else:
                    dropped += [o for o, _ in held[q_name]]
                held.pop(q_name)
            continue
        if name in table:
            written.setdefault(name, []).append(tuple(w.shape))
        else:
            dropped.append(original)
    dropped += [o for pair in held.values() for o, _ in pair]  # waited for a partner that never came
    return _load_report(written, table, dropped, hot_token_id)


SGLANG_FROM_TARGET = {"model.embed_tokens.weight"}  # set_embed(target embedding) for EAGLE3


MLP_STACKED = [(".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]


STACKED = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    *MLP_STACKED,
]


def sglang_load_report(tensors: dict[str, torch.Tensor], table: dict[str, tuple[int, ...]]) -> dict:
    """Replay sglang 0.5.23 load_weights name handling. Returns consumed/dropped keys, unwritten params and
    shape problems (stacked shards are summed along dim 0 and compared with the fused parameter)."""
    legacy = {
        "midlayer": "layers.0",
        "aux_norm_low": "fc_norm.0",
        "aux_norm_mid": "fc_norm.1",
        "aux_norm_high": "fc_norm.2",
    }
    written: dict[str, list[tuple[int, ...]]] = {}
    dropped, hot_token_id = [], None
    for original, w in tensors.items():
        name = original
        for old, new in legacy.items():
            if old in name:
                name = name.replace(old, new)
        if "d2t" in name:
            hot_token_id = w + torch.arange(w.shape[0])
            continue
        if "t2d" in name:
            continue
        for fused, shard, _ in STACKED:
            if shard in name:
                name = name.replace(shard, fused)
                break
        target = name if name in table else f"model.{name}"
        if target in table:
            written.setdefault(target, []).append(tuple(w.shape))
        else:
            dropped.append(original)
    return _load_report(written, table, dropped, hot_token_id)


def _load_report(written: dict, table: dict, dropped: list, hot_token_id) -> dict:
    """A replay's result: stacked shards summed along dim 0 and compared with the fused parameter, and the
    parameters nothing wrote (the embedding is the target's)."""
    shape_problems = []
    for param, shapes in written.items():
        want = table[param]
        got = (sum(s[0] for s in shapes), *shapes[0][1:]) if len(shapes) > 1 else shapes[0]
        if got != want:
            shape_problems.append(f"{param}: export gives {got}, engine has {want}")
    unwritten = sorted(set(table) - set(written) - SGLANG_FROM_TARGET)
    return {
        "dropped": dropped,
        "unwritten": unwritten,
        "shape_problems": shape_problems,
        "hot_token_id": hot_token_id,
    }
