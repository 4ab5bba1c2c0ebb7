"""SGLang's DeepSeek-V3 class (Kimi-K2.x's text model) against our numbering, on CPU: its
`set_eagle3_layers_to_capture` reads ids by their first element (export_layouts.SGLANG_FIRST_ID_RULE), and our
ids must still make it capture the outputs of our layers. Runs in .venv-engines (tests/integration/
test_sglang_capture.py launches it) with EAGLEPIPE_CONTRACT_KIMI_TARGET = the built `kimi_tiny` folder."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipeline.engines import shims  # noqa: E402

shims.install()
pytest.importorskip("sglang")  # the main venv has none: this module runs in .venv-engines
from pipeline.engines import sglang_capture as sc  # noqa: E402
from pipeline.formats import export_layouts as lay  # noqa: E402


@pytest.fixture(scope="module")
def kimi():
    path = os.environ.get("EAGLEPIPE_CONTRACT_KIMI_TARGET")
    assert path, "set EAGLEPIPE_CONTRACT_KIMI_TARGET to the built kimi_tiny folder"
    return sc.build_target_on_meta(path)


def test_the_kimi_tiny_target_is_sglangs_deepseek_v3_class_with_mla_and_moe(kimi):
    assert type(kimi).__name__ == "DeepseekV3ForCausalLM" and type(kimi).__name__ in lay.SGLANG_FIRST_ID_RULE
    layers = sc.decoder_of(kimi).layers
    assert len(layers) == 8
    kinds = [type(layer.mlp).__name__ for layer in layers]
    assert kinds[0] == "DeepseekV2MLP" and set(kinds[1:]) == {"DeepseekV2MoE"}  # first_k_dense_replace = 1
    assert hasattr(layers[0].self_attn, "kv_a_layernorm")  # MLA: a compressed KV with its own norm


@pytest.mark.parametrize("ids", [[1, 2, 3], [2, 3, 4]])
def test_the_class_reads_ids_by_their_first_element_as_our_replay_says(kimi, ids):
    kimi.set_eagle3_layers_to_capture(ids)
    assert sc.decoder_of(kimi).layers_to_capture == lay.sglang_capture_points(ids, "DeepseekV3ForCausalLM")
    assert lay.sglang_capture_points([1, 2, 3], "DeepseekV3ForCausalLM") == [2, 3, 4]  # +1, as Llama
    assert lay.sglang_capture_points([2, 3, 4], "DeepseekV3ForCausalLM") == [2, 3, 4]  # as given


@pytest.mark.parametrize("ours", [[1, 2, 3], [2, 3, 4], [1, 4], [3]])
def test_our_ids_make_the_deepseek_class_capture_the_outputs_of_our_layers(kimi, ours):
    assert sc.request_capture(kimi, ours) == [k + 1 for k in ours]  # request_capture raises otherwise


def test_plain_llama_numbering_would_capture_the_wrong_layers_on_this_class(kimi):
    # the trap: without the first-id rule, our [2, 3, 4] would capture the outputs of [1, 2, 3]
    kimi.set_eagle3_layers_to_capture([2, 3, 4])
    assert sc.decoder_of(kimi).layers_to_capture != [3, 4, 5]


def test_an_output_of_layer_0_first_cannot_be_asked_of_this_class():
    with pytest.raises(lay.AuxIdsUnservable, match="start the aux layers at 1"):
        lay.sglang_layer_ids([0, 2, 4], "DeepseekV3ForCausalLM")
    assert lay.sglang_layer_ids([0, 2, 4], "LlamaForCausalLM") == [0, 2, 4]


def test_the_kimi_k25_wrapper_hands_capture_to_its_deepseek_language_model(kimi):
    """KimiK25ForConditionalGeneration (Kimi-K2.5's own class) around kimi_tiny's text config, with a 1-layer
    vision tower: it cannot be built from kimi_tiny's folder (no vision config), so it is built here directly.
    The capture request goes through the wrapper to its DeepseekV3 language model, one level deeper."""
    import torch
    from sglang.srt.configs.kimi_k25 import KimiK25Config
    from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration

    text = {k: v for k, v in kimi.config.to_dict().items() if k not in ("architectures", "model_type")}
    vision = dict(
        num_attention_heads=2,
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        mm_hidden_size=32,
        vt_hidden_size=32,
        text_hidden_size=kimi.config.hidden_size,
    )
    with torch.device("meta"):
        config = KimiK25Config(
            text_config=text, vision_config=vision, encoder_only=False, language_only=False
        )
        wrapper = KimiK25ForConditionalGeneration(config)
    assert type(wrapper.language_model).__name__ == "DeepseekV3ForCausalLM"
    assert sc.decoder_of(wrapper) is wrapper.language_model.model
    assert sc.request_capture(wrapper, [2, 3, 5]) == [3, 4, 6]  # the first-id rule holds through the wrapper
    assert wrapper.language_model.capture_aux_hidden_states is True
