"""The conversion of a GGUF target into a bf16 HF folder is checked against the GGUF itself, for every GGUF
target (pipeline/models/gguf_targets.py: check_conversion). Runs on the embedded SmolLM2, so CI proves both of
the check's refusals can fire; the Qwen2.5-Coder tests run the same check on that target when its wheels are
installed."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.errors import UserError
from pipeline.models import gguf_targets, targets


@pytest.fixture(scope="module")
def gguf_model(smol_folder):
    """The reference the check compares against: the folder's own weights, loaded in fp32. They are the
    GGUF's rounded to bf16 (the first test shows the real check passed on them), so rounding is exact on them
    and the refusals below come from the damage alone; loading the GGUF again would cost CI 30 s."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_folder, dtype=torch.float32).eval()


def copy_folder(smol_folder, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(smol_folder, bad)
    return bad


def check(gguf_model, folder):
    from transformers import AutoTokenizer

    return gguf_targets.check_conversion(gguf_model, AutoTokenizer.from_pretrained(folder), folder)


def test_the_embedded_targets_folder_records_its_check_against_the_gguf(smol_folder):
    c = json.loads((smol_folder / targets.MARKER).read_text())["conversion_check"]
    assert c["tensors_equal_gguf_in_bf16"] and c["max_logit_diff"] <= c["tolerance"]
    # bf16 rounding itself moves the logits (0.42 of 40 measured on SmolLM2): recorded, not a limit
    assert c["rounding_logit_diff"] > c["tolerance"] > 0
    assert c["greedy_tokens_equal"] >= 0.9 * c["greedy_positions"] > 0
    assert c["greedy_differing_max_gap"] <= 2 * c["rounding_logit_diff"]  # the others: near-ties


def test_a_folder_whose_config_differs_is_refused_though_its_tensors_are_the_ggufs(
    gguf_model, smol_folder, tmp_path
):
    bad = copy_folder(smol_folder, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    config["rms_norm_eps"] = 1e-2  # the GGUF's: 1e-5
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"moves the logits by .* its config differs; nothing was"):
        check(gguf_model, bad)


def test_a_folder_with_a_tensor_not_the_ggufs_is_refused_naming_it(gguf_model, smol_folder, tmp_path):
    bad = copy_folder(smol_folder, tmp_path)
    weights = load_file(str(smol_folder / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.01
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    wrong = r"does not hold the GGUF's tensors rounded to bf16 \(model.norm.weight\)"
    with pytest.raises(UserError, match=wrong):
        check(gguf_model, bad)
