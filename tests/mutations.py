"""Edits that inject a seed failure into a good export (tensors or config.json), and a copy-and-edit helper.
Shared by tests/integration/test_export.py and test_mutations.py (tests/ is on pytest's pythonpath)."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def mutated_copy(src: Path, dst: Path, tensors=None, config=None) -> Path:
    """A copy of export folder `src` at `dst` with its tensors and/or config.json edited in place."""
    shutil.copytree(src, dst)
    if tensors:
        t = load_file(str(dst / "model.safetensors"))
        save_file(tensors(t), str(dst / "model.safetensors"))
    if config:
        c = json.loads((dst / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


def prefix_keys(t, prefix):
    """Every weight renamed with a prefix (e.g. `draft_model.`): names no loader knows."""
    return {(prefix + k if k not in ("d2t", "t2d") else k): v for k, v in t.items()}


def pre_rename_keys(t):
    """`midlayer.*` -> `layers.0.*`: what an SGLang before the model.layers.0 rename drops silently."""
    return {
        ("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in t.items()
    }


def absolute_d2t(t):
    t["d2t"] = t["d2t"] + torch.arange(len(t["d2t"]))
    return t


def zero_fc(t):
    t["fc.weight"] = torch.zeros_like(t["fc.weight"])
    return t


def single_layer_fc(t):
    t["fc.weight"] = t["fc.weight"][:, : t["fc.weight"].shape[0]].contiguous()
    return t


def nan_norm(t):
    t["norm.weight"] = t["norm.weight"].clone()
    t["norm.weight"][0] = float("nan")
    return t
