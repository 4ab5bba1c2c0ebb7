"""Build the EAGLE-3 draft: speculators' Eagle3DraftModel (public API) shaped from the target.

One decoder layer, fc: n_aux*H -> H, draft vocabulary from run_dir/vocab, aux layer ids from the feature
store's facts (there is no config key for them here). Embeddings and the verifier lm_head/norm come from the
target through speculators' `load_verifier_weights`, which also initialises the draft lm_head from the
target's rows. The layer (`train.draft_arch`, export_layouts.DRAFT_ARCHS):
- `llama`: speculators' own Llama layer (SGLang's LlamaForCausalLMEagle3 layout), whatever the target's
family.
- `mla`: DeepSeek-V2/V3 multi-latent attention with the target's MLA shapes (SGLang's
Eagle3DeepseekV2ForCausalLM
  layout, published Kimi-K2.5 drafts): speculators has no MLA draft, so `_mla_components` adds one to its
  layer registry in the style of its Llama layer (its Eagle3FirstLayerMixin over transformers'
  DeepseekV3DecoderLayer, the two down projections widened to the 2H input); the rest of Eagle3DraftModel (TTT
  unroll, masks, loss) is speculators' own.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.errors import UserError
from pipeline.formats import export_layouts as lay
from pipeline.lazy_compile import compile_deferred

# train.attn_implementation: the draft layer's attention as speculators runs it. sdpa and eager take dense TTT
# masks; simple_flex_attention (speculators' own default) takes block masks and skips the masked blocks:
# 1.8-2.8x the step of an 8B-shaped draft on an H200 (docs/scale.md), GPU only (FlexAttention has no CPU
# backward)
ATTENTION = ("sdpa", "eager", "simple_flex_attention")


def layer_config(target_hf, attn: str, overrides: dict | None = None, arch: str = "llama"):
    """The draft decoder layer's config, with the target's shapes."""
    if arch == "mla":
        return mla_layer_config(target_hf, attn, overrides)
    t = target_hf
    heads = t.num_attention_heads
    # An MLA target (DeepSeek-V2/V3, Kimi-K2.x: kv_lora_rank set) has no single head size; HF's
    # DeepseekV3Config calls its rope part `head_dim` (64 for Kimi). The draft's plain attention takes the
    # value head size (128 for Kimi-K2.5, as conf/target/kimi_k25.yaml declares).
    head_dim = (
        t.v_head_dim
        if getattr(t, "kv_lora_rank", None)
        else getattr(t, "head_dim", None) or t.hidden_size // heads
    )
    shape = dict(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=t.rms_norm_eps,
        max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=False,
        rope_parameters=getattr(t, "rope_parameters", None)
        or {"rope_type": "default", "rope_theta": 10000.0},
    )
    shape.update(overrides or {})
    from transformers import LlamaConfig  # here: train's check reads ATTENTION in `eaglepipe submit` (~3 s)

    cfg = LlamaConfig(num_hidden_layers=1, **shape)
    cfg._attn_implementation = attn
    return cfg


MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def mla_layer_config(target_hf, attn: str, overrides: dict | None = None):
    """A one-layer DeepseekV3Config with the target's MLA shapes and a dense MLP of its dense width (the
    config a
    served Eagle3DeepseekV2ForCausalLM reads: its attention is sglang's DeepseekV2AttentionMLA)."""
    from transformers import DeepseekV3Config

    t = target_hf
    missing = [k for k in MLA_KEYS if getattr(t, k, None) is None]
    if missing:
        raise UserError(
            f"train.draft_arch=mla takes its attention shapes from an MLA target (DeepSeek-V2/V3, "
            f"Kimi-K2.x); this target's config has no {', '.join(missing)}: use train.draft_arch=llama"
        )
    shape = dict(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_attention_heads,
        **{k: getattr(t, k) for k in MLA_KEYS},
        rms_norm_eps=t.rms_norm_eps,
        hidden_act=t.hidden_act,
        max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=False,
        attention_bias=False,
        rope_interleave=getattr(t, "rope_interleave", True),
        rope_parameters=getattr(t, "rope_parameters", None)
        or {"rope_type": "default", "rope_theta": 10000.0},
        # layer 0 dense (DeepseekV3DecoderLayer): the MoE fields stay unused defaults
        first_k_dense_replace=1,
    )
    shape.update(overrides or {})
    cfg = DeepseekV3Config(num_hidden_layers=1, **shape)
    cfg._attn_implementation = attn
    _mla_components()
    return cfg


def _mla_components() -> None:
    """Register the MLA first layer under model_type deepseek_v3 in speculators' layer registry
    (idempotent)."""
    with compile_deferred():
        from speculators.models.base_components import ModelComponents
        from speculators.models.eagle3 import model_definitions as md
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    if "deepseek_v3" in md.model_classes:
        return

    class DeepseekV3DecoderEagle3FirstLayer(md.Eagle3FirstLayerMixin, ds.DeepseekV3DecoderLayer):
        """speculators' Eagle3 first layer over MLA: cat([norm(embed), norm(hidden)]) into the q and kv down
        projections (2H wide, as sglang's fused_qkv_a_proj_with_mqa), residual = the hidden half."""

        def __init__(self, config, layer_idx: int, norm_before_residual: bool = False):
            super().__init__(config, layer_idx)
            self.norm_before_residual = norm_before_residual
            self.hidden_norm = ds.DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            a, wide = self.self_attn, 2 * config.hidden_size
            a.q_a_proj = torch.nn.Linear(wide, config.q_lora_rank, bias=False)
            a.kv_a_proj_with_mqa = torch.nn.Linear(
                wide, config.kv_lora_rank + config.qk_rope_head_dim, bias=False
            )
            for norm in (a.q_a_layernorm, a.kv_a_layernorm):  # sglang builds both with the config's eps
                norm.variance_epsilon = config.rms_norm_eps

    md.model_classes["deepseek_v3"] = ModelComponents(
        DeepseekV3DecoderEagle3FirstLayer,
        ds.DeepseekV3DecoderLayer,
        ds.DeepseekV3RMSNorm,
        ds.DeepseekV3RotaryEmbedding,
    )


def build(
    target_folder: Path | None,
    target_hf,
    aux_ids: list[int],
    d2t: torch.Tensor | None,
    t2d: torch.Tensor | None,
    ttt_steps: int,
    attn: str = "sdpa",
    load_target_weights: bool = True,
    overrides: dict | None = None,
    draft_vocab_size: int | None = None,
    arch: str = "llama",
):
    with compile_deferred():
        from speculators.config import SpeculatorsConfig, VerifierConfig
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
        from speculators.proposals.greedy import GreedyTokenProposalConfig

    _mla_components()  # speculators resolves the layer class from the config's model_type at construction
    verifier = (
        VerifierConfig.from_pretrained(str(target_folder))
        if target_folder is not None
        else VerifierConfig(
            name_or_path=None, architectures=list(getattr(target_hf, "architectures", None) or [])
        )
    )
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config(target_hf, attn, overrides, arch),
        draft_vocab_size=int(d2t.shape[0]) if d2t is not None else draft_vocab_size,
        norm_before_residual=False,
        target_hidden_size=target_hf.hidden_size,
        eagle_aux_hidden_state_layer_ids=list(aux_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
            default_proposal_method="greedy",
            verifier=verifier,
        ),
    )
    model = Eagle3DraftModel(config)
    if d2t is not None:
        model.load_vocab_mappings(t2d, d2t)
    if load_target_weights:
        model.load_verifier_weights()
    return model


def own_parameters(model) -> int:
    """Parameters the draft trains and ships: all but the target's (export_layouts.TARGET_OWNED)."""
    return sum(p.numel() for p in lay.draft_owned(dict(model.named_parameters())).values())


def build_on_meta(target, draft_vocab_size: int, aux_ids: list[int], ttt_steps: int = 3):
    """The draft at the target's declared shape on the meta device: sizes without allocating memory."""
    from types import SimpleNamespace

    missing = [
        k
        for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
        if target.get(k) is None
    ]
    if missing:
        raise ValueError(f"target {target.name} declares no {', '.join(missing)}; needed to size the draft")
    shape = SimpleNamespace(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        architectures=[],
    )
    with torch.device("meta"):
        return build(
            None,
            shape,
            aux_ids,
            None,
            None,
            ttt_steps,
            attn="sdpa",
            load_target_weights=False,
            draft_vocab_size=draft_vocab_size,
        )
