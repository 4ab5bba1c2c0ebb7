"""The exported draft as the engines read it: a reference forward over the export's own tensors (the Llama
layout's or the MLA first layer's attention, rotary as the config says), used by the offline bench so that
what is measured is the checkpoint that is served."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.formats import export_layouts as lay


class ExportedDraft:
    """SGLang's EAGLE-3 draft forward (one layer, no tree), from an export's tensors, in fp32:
    LlamaForCausalLMEagle3
    (GQA attention) or Eagle3DeepseekV2ForCausalLM (multi-latent attention), whichever its config.json
    names."""

    def __init__(self, tensors: dict, config: dict, embed: torch.Tensor, device: torch.device | str = "cpu"):
        self.w = {k: (v.float() if v.is_floating_point() else v).to(device) for k, v in tensors.items()}
        self.c, self.embed = config, embed.float().to(device)
        self.heads = config["num_attention_heads"]
        self.eps = config["rms_norm_eps"]
        self.mla = lay.draft_arch_of_export(config).name == "mla"
        if self.mla:
            self.nope, self.rope_dim, self.vd = (
                config["qk_nope_head_dim"],
                config["qk_rope_head_dim"],
                config["v_head_dim"],
            )
            self.kv_lora = config["kv_lora_rank"]
            self.rotary, self.scale = _mla_rotary(config)
            self.rotary = self.rotary.to(device)
        else:
            self.kv = config["num_key_value_heads"]
            self.hd = config.get("head_dim") or config["hidden_size"] // self.heads
            self.rotary = _rotary(config, self.hd).to(
                device
            )  # the rope the config names (yarn for Kimi), as trained
        # no d2t: a full-vocabulary draft (vocab_map.full); SGLang keeps hot_token_id None: draft = target id
        full = torch.zeros(len(self.w["lm_head.weight"]), dtype=torch.long, device=device)
        self.d2t = self.w.get("d2t", full)

    def _rms(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def _rope(self, x, pos, half: int):
        """x [B, heads, N, d] rotated (half-split) at positions pos [B, N]."""
        cos, sin = self.rotary(x, pos)  # [B, N, d], attention scaling (yarn's mscale) included
        cos, sin = cos[:, None], sin[:, None]
        x1, x2 = x[..., :half], x[..., half:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return aux.float() @ self.w["fc.weight"].T

    def inputs(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's 2H input at each position: cat(input_layernorm(embed(token)), hidden_norm(hidden))."""
        e = self._rms(self.embed[tokens], "midlayer.input_layernorm.weight")
        return torch.cat([e, self._rms(hidden, "midlayer.hidden_norm.weight")], -1)

    def qkv(self, x: torch.Tensor, pos: torch.Tensor):
        """(q, k, v), each [B, heads, N, d], of inputs x [B, N, 2H] at positions pos [B, N]; k and v per head
        (GQA
        repeated, MLA expanded from the latent), so a cache of them is attention's whole input."""
        return (self._mla if self.mla else self._gqa)(x, pos)

    def _gqa(self, x: torch.Tensor, pos: torch.Tensor):
        p, w, (B, N) = "midlayer.self_attn.", self.w, x.shape[:2]
        q = (x @ w[p + "q_proj.weight"].T).view(B, N, self.heads, self.hd).transpose(1, 2)
        k = (x @ w[p + "k_proj.weight"].T).view(B, N, self.kv, self.hd).transpose(1, 2)
        v = (x @ w[p + "v_proj.weight"].T).view(B, N, self.kv, self.hd).transpose(1, 2)
        q, k = self._rope(q, pos, self.hd // 2), self._rope(k, pos, self.hd // 2)
        rep = self.heads // self.kv
        return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def _mla(self, x: torch.Tensor, pos: torch.Tensor):
        """Multi-latent attention, unabsorbed: q through its LoRA, one shared latent (kv_lora) + one shared
        rope key per token, expanded per head by kv_b; the rope part rotated GPT-J style (interleaved pairs),
        as
        DeepseekV2AttentionMLA's is_neox_style=False."""
        p, w, (B, N), H = "midlayer.self_attn.", self.w, x.shape[:2], self.heads
        q = self._rms(x @ w[p + "q_a_proj.weight"].T, p + "q_a_layernorm.weight") @ w[p + "q_b_proj.weight"].T
        q = q.view(B, N, H, self.nope + self.rope_dim).transpose(1, 2)
        ckv = x @ w[p + "kv_a_proj_with_mqa.weight"].T
        latent, k_rot = ckv[..., : self.kv_lora], ckv[..., self.kv_lora :]
        kv = (self._rms(latent, p + "kv_a_layernorm.weight") @ w[p + "kv_b_proj.weight"].T).view(
            B, N, H, self.nope + self.vd
        )
        k_nope, v = kv[..., : self.nope].transpose(1, 2), kv[..., self.nope :].transpose(1, 2)

        def rot(t):  # interleaved pairs (x0, x1), (x2, x3), ... -> halves, then the half-split rotation
            t = t.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
            return self._rope(t, pos, self.rope_dim // 2)

        q_rot, k_rot = rot(q[..., self.nope :]), rot(k_rot[:, None])
        q = torch.cat([q[..., : self.nope], q_rot], -1)
        return q, torch.cat([k_nope, k_rot.expand(-1, H, -1, -1)], -1), v

    def attend(self, q, k, v, mask=None, causal: bool = False) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale if self.mla else None
        )

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + o_proj of attention [B, heads, N, dv] over the raw hidden input [B, N, H], then the
        MLP."""
        p, w = "midlayer.", self.w
        h = hidden + attn.transpose(1, 2).flatten(2) @ w[p + "self_attn.o_proj.weight"].T
        y = self._rms(h, p + "post_attention_layernorm.weight")
        mlp = (F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) @ w[
            p + "mlp.down_proj.weight"
        ].T
        return h + mlp

    def layer(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The layer over one sequence ([T] tokens, [T, H] hidden, [T] positions), causal: outputs [T, H]."""
        q, k, v = self.qkv(self.inputs(tokens[None], hidden[None]), pos[None])
        return self.finish(hidden[None], self.attend(q, k, v, causal=True))[0]

    def logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        return self._rms(out_hidden, "norm.weight") @ self.w["lm_head.weight"].T

    def next_target_id(self, out_hidden: torch.Tensor) -> int:
        d = int(torch.argmax(self.logits(out_hidden)))
        return d + int(self.d2t[d])

    def next_target_ids(self, out_hidden: torch.Tensor) -> torch.Tensor:
        """[B, H] -> [B] target ids, on the device."""
        d = self.logits(out_hidden).argmax(-1)
        return d + self.d2t[d]


def _rotary(config: dict, head_dim: int):
    """transformers' Llama rotary embedding for the export's rope (default, yarn, ...): the one the draft
    trained with (speculators builds its layer from a LlamaConfig) and the one SGLang's Llama draft reads from
    config.json."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = dict(config.get("rope_parameters") or {"rope_type": "default"})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return LlamaRotaryEmbedding(
        LlamaConfig(
            hidden_size=config["hidden_size"],
            head_dim=head_dim,
            num_attention_heads=config["num_attention_heads"],
            max_position_embeddings=config["max_position_embeddings"],
            rope_parameters=rope,
        )
    )


def _mla_rotary(config: dict):
    """(transformers' DeepSeek-V3 rotary embedding for the export's rope, the softmax scale): what the MLA
    draft
    trained with, and what DeepseekV2AttentionMLA computes from the same config (yarn: mscale on both)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        yarn_apply_mscale,
    )

    rope = dict(config.get("rope_parameters") or {"rope_type": "default"})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    c = DeepseekV3Config(
        hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        max_position_embeddings=config["max_position_embeddings"],
        rope_parameters=rope,
    )
    scale = yarn_apply_mscale(
        c.rope_parameters, (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]) ** -0.5
    )
    return DeepseekV3RotaryEmbedding(c), scale
