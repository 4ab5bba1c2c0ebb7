from pipeline import draft
from pipeline.extract import aux_layer_ids


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
