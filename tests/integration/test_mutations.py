"""The seed failures, injected one by one into a good export: each is caught by verify, doctor or both.

The failures (README "Why"): (1) a key the engine's loader skips without a word (`draft_model.` prefix;
`layers.0.*` given to an SGLang that predates the model.layers.0 rename); (2) aux ids removed, so the engine
captures its default layers; (3) the server started with EAGLE, not EAGLE3, so no aux state reaches fc;
(4) d2t turned into absolute ids; (5) fc zeroed (a "loaded" weight that carries nothing); (6) an fc of
single-layer width (the draft fed one 576-dim state, not 3 concatenated). verify = engine-free checks
plus the engine's OWN class, loader and config resolution (pipeline/engines/verify.py); doctor =
pipeline/tools/doctor.py.
"""

import pytest
from mutations import absolute_d2t, pre_rename_keys, prefix_keys, single_layer_fc, zero_fc

from pipeline.engines.verify import check_export, engine_problems, engine_report
from pipeline.tools.doctor import diagnose

pytestmark = pytest.mark.slow


def _no_aux_ids(c):
    c["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")


@pytest.fixture(scope="module")
def good(exported_run):
    run_dir, facts = exported_run
    return run_dir / "export" / "sglang", facts


def caught(folder, facts, launch=None, algorithm="EAGLE3"):
    """Findings of verify (engine-free, then SGLang's own class whatever the first found) and doctor."""
    found = check_export(folder, "sglang", facts)
    found += engine_problems(
        engine_report(folder, "sglang", facts["target_path"], algorithm=algorithm), facts["aux_layer_ids"]
    )
    if launch:
        found += diagnose(folder, launch)
    return found


def test_1a_draft_model_prefix_is_dropped_silently_by_sglang_and_caught(good, mutate, tmp_path):
    folder, facts = good
    found = caught(
        mutate(folder, tmp_path / "sglang", tensors=lambda t: prefix_keys(t, "draft_model.")), facts
    )
    assert any("LlamaForCausalLMEagle3 (sglang 0.5.23) silently dropped 13 tensors" in f for f in found), (
        found
    )
    assert any("would silently drop" in f for f in found), found


def test_1b_layers0_for_an_sglang_before_the_rename_is_caught(good, mutate, tmp_path):
    folder, facts = good
    bad = mutate(folder, tmp_path / "sglang", tensors=pre_rename_keys)
    assert any("SGLang before the model.layers.0 rename" in f for f in check_export(bad, "sglang", facts))
    # and doctor: the vLLM layout (layers.0.*) handed to an SGLang launch line
    line = (folder / "serve.sh").read_text().replace("export/sglang", "export/vllm")
    assert any(
        "vllm's layout but the line starts sglang" in f for f in diagnose(folder.parent / "vllm", line)
    )


def test_2_aux_ids_removed_is_caught_by_config_check_and_by_what_sglang_reads(good, mutate, tmp_path):
    folder, facts = good
    found = caught(mutate(folder, tmp_path / "sglang", config=_no_aux_ids), facts)
    assert any("aux layer ids missing" in f for f in found), found
    assert any("reads aux layer ids None from the config" in f for f in found), found


def test_3_eagle_instead_of_eagle3_is_caught_by_doctor_and_by_sglang_own_resolution(good):
    folder, facts = good
    line = (folder / "serve.sh").read_text().replace("EAGLE3", "EAGLE")
    found = caught(folder, facts, launch=line, algorithm="EAGLE")
    assert any("not EAGLE3" in f for f in found), found  # doctor
    assert any("would not feed aux hidden states to the draft" in f for f in found), found  # SGLang itself


def test_4_absolute_d2t_is_caught(good, mutate, tmp_path):
    folder, facts = good
    found = caught(mutate(folder, tmp_path / "sglang", tensors=absolute_d2t), facts)
    assert any(f.startswith("vocab:") and "absolute" in f for f in found), found
    assert any("draft->target ids (arange + d2t) are not the t2d ids" in f for f in found), found


def test_5_zeroed_fc_is_caught_by_std_and_norm_not_by_mean(good, mutate, tmp_path):
    folder, facts = good
    found = caught(mutate(folder, tmp_path / "sglang", tensors=zero_fc), facts)
    assert any("fc.weight is constant (std 0, norm 0)" in f for f in found), found


def test_6_single_layer_width_fc_is_caught(good, mutate, tmp_path):
    folder, facts = good
    found = caught(mutate(folder, tmp_path / "sglang", tensors=single_layer_fc), facts)
    assert any("fc.weight takes 64 inputs, expected n_aux x hidden = 3 x 64" in f for f in found), found
    assert any("raised while loading" in f for f in found), found


def test_the_good_export_passes_all_of_it(good):
    folder, facts = good
    assert caught(folder, facts, launch=(folder / "serve.sh").read_text()) == []
