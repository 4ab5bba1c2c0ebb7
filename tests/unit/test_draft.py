from pipeline.capture.aux_layers import aux_layer_ids
from pipeline.models import draft


def test_kimi_k25_draft_builds_on_meta_with_the_seed_shape(make_cfg):
    cfg = make_cfg("target=kimi_k25")
    aux = aux_layer_ids(None, cfg.target.num_layers)
    model = draft.build_on_meta(cfg.target, cfg.vocab.draft_vocab_size, aux)
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing allocated
    assert (model.fc.in_features, model.fc.out_features) == (21504, 7168)
    assert model.lm_head.weight.shape == (32000, 7168) and model.embed_tokens.weight.shape == (163840, 7168)
    assert model.config.eagle_aux_hidden_state_layer_ids == [1, 29, 57]
    own = draft.own_parameters(model)
    print(f"kimi_k25 draft: {own:,} own parameters")
    assert 1.1e9 < own < 1.3e9


def test_the_target_owned_names_are_the_drafts_and_everything_else_is_what_both_layouts_load():
    from types import SimpleNamespace

    from pipeline.formats import export_layouts as lay
    from pipeline.formats import sglang_params as sgl_params

    t = SimpleNamespace(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        architectures=[],
    )
    model = draft.build(None, t, [1, 2, 3], None, None, 1, load_target_weights=False, draft_vocab_size=8)
    names = dict(model.named_parameters())
    assert lay.TARGET_OWNED <= set(names)  # a rename in speculators fails here, not in a silent export
    own = lay.draft_owned(model.state_dict())
    assert not set(own) & lay.TARGET_OWNED and set(model.state_dict()) - set(own) == lay.TARGET_OWNED
    assert draft.own_parameters(model) == sum(
        p.numel() for n, p in names.items() if n not in lay.TARGET_OWNED
    )
    # what is left is exactly what SGLang's loader writes (the embedding it takes from the target) ...
    shape = sgl_params.Shape(
        hidden=16,
        target_hidden=16,
        n_aux=3,
        heads=2,
        kv_heads=1,
        head_dim=8,
        intermediate=32,
        vocab=64,
        draft_vocab=8,
    )
    report = sgl_params.sglang_load_report(
        {lay.speculators_to_sglang_name(k): v for k, v in own.items()}, sgl_params.sglang_param_table(shape)
    )
    assert (report["dropped"], report["unwritten"], report["shape_problems"]) == ([], [], [])
    # ... and only names vLLM's eagle3 loader knows
    assert all(k.startswith(("layers.0.", "fc.", "norm.", "lm_head.")) or k in ("d2t", "t2d") for k in own)
