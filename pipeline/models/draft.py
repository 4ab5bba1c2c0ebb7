"""Build the EAGLE-3 draft: speculators' Eagle3DraftModel (public API) shaped from the target.

One Llama-style decoder layer (SGLang's LlamaForCausalLMEagle3 layout, whatever the target's architecture),
fc: n_aux*H -> H, draft vocabulary from run_dir/vocab, aux layer ids from the feature store's facts (there
is no config key for them here). Embeddings and the verifier lm_head/norm come from the target through
speculators' `load_verifier_weights`, which also initialises the draft lm_head from the target's rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from transformers import LlamaConfig

from pipeline.formats import export_layouts as lay


def layer_config(target_hf, attn: str, overrides: Optional[dict] = None) -> LlamaConfig:
    """The draft decoder layer's config, with the target's shapes."""
    t = target_hf
    heads = getattr(t, "num_attention_heads")
    # An MLA target (DeepSeek-V2/V3, Kimi-K2.x: kv_lora_rank set) has no single head size; HF's DeepseekV3Config
    # calls its rope part `head_dim` (64 for Kimi). The draft's plain attention takes the value head size (128
    # for Kimi-K2.5, as conf/target/kimi_k25.yaml declares).
    head_dim = (t.v_head_dim if getattr(t, "kv_lora_rank", None) else
                getattr(t, "head_dim", None) or t.hidden_size // heads)
    shape = dict(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_attention_heads=heads, num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
        head_dim=head_dim, rms_norm_eps=t.rms_norm_eps,
        max_position_embeddings=t.max_position_embeddings, tie_word_embeddings=False,
        rope_parameters=getattr(t, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0},
    )
    shape.update(overrides or {})
    cfg = LlamaConfig(num_hidden_layers=1, **shape)
    cfg._attn_implementation = attn
    return cfg


def build(target_folder: Optional[Path], target_hf, aux_ids: list[int], d2t: Optional[torch.Tensor],
          t2d: Optional[torch.Tensor], ttt_steps: int, attn: str = "sdpa", load_target_weights: bool = True,
          overrides: Optional[dict] = None, draft_vocab_size: Optional[int] = None):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    verifier = (VerifierConfig.from_pretrained(str(target_folder)) if target_folder is not None
                else VerifierConfig(name_or_path=None, architectures=list(getattr(target_hf, "architectures", None) or [])))
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config(target_hf, attn, overrides), draft_vocab_size=int(d2t.shape[0]) if d2t is not None else draft_vocab_size,
        norm_before_residual=False, target_hidden_size=target_hf.hidden_size,
        eagle_aux_hidden_state_layer_ids=list(aux_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
            default_proposal_method="greedy", verifier=verifier))
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

    missing = [k for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
               if target.get(k) is None]
    if missing:
        raise ValueError(f"target {target.name} declares no {', '.join(missing)}; needed to size the draft")
    shape = SimpleNamespace(vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                            intermediate_size=target.intermediate_size, num_attention_heads=target.num_attention_heads,
                            num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
                            rms_norm_eps=1e-6, max_position_embeddings=262144, architectures=[])
    with torch.device("meta"):
        return build(None, shape, aux_ids, None, None, ttt_steps, attn="sdpa", load_target_weights=False,
                     draft_vocab_size=draft_vocab_size)
