"""Serving layouts of the EAGLE-3 draft, and the engines' loaders as read from their source. Pure module.

Engine facts (sglang 0.5.23 `sglang/srt/models/llama_eagle3.py`, `sglang/srt/speculative/eagle_worker_v2.py`;
vllm 0.33.0 `vllm/model_executor/models/llama_eagle3.py`, `vllm/model_executor/models/llama.py`):
- SGLang `LlamaForCausalLMEagle3.load_weights`: legacy `midlayer` -> `layers.0`; `d2t` -> hot_token_id =
  d2t + arange; `t2d` skipped; q/k/v -> qkv_proj, gate/up -> gate_up_proj; a name found neither as is nor
  with a `model.` prefix is dropped WITHOUT a message. The embedding always comes from the target
  (`set_embed`, EAGLE3 branch of `init_lm_head`); without `draft_vocab_size` in config.json SGLang takes the
  target's lm_head instead of the draft's (`load_lm_head_from_target`).
- SGLang aux ids: `eagle_config.eagle_aux_hidden_state_layer_ids`, id k = output of decoder layer k (ours) for
  Llama-family targets; DeepSeek-V2/V3 and Kimi-K2.5 targets number them by their first id
  (SGLANG_FIRST_ID_RULE).
- vLLM (speculators format): keys `layers.0.*`; aux ids `eagle_aux_hidden_state_layer_ids`, id k = input of
  layer k = our k-1, so vLLM id = ours + 1.
`sglang_load_report` replays SGLang's name mapping over an export's tensors against the parameter table of
its module tree: a derived table, kept as the engine-free check; pipeline/engines/ loads into the engines'
own classes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.errors import UserError
from pipeline.formats import faults, file_digest

SCHEMA_VERSION = 1
MANIFEST = "export_manifest.json"  # an export's provenance, numbering, tensor table, serve record
# The files whose sha256 the manifest records (`files`) when the export is published (serve.sh again when
# tune-serve rewrites it); `damage` checks them before the export is taken as fresh or read.
FILES = ("model.safetensors", "config.json", "serve.sh")


def record_files(folder, manifest: dict, names: tuple[str, ...] = FILES) -> None:
    """manifest["files"]: the sha256 of `names` in folder, as they are now."""
    manifest["files"] = {**manifest.get("files", {}), **file_digest.record(folder, list(names))}


def damage(folder) -> str | None:
    """What is wrong with a published export (None: intact): its manifest unreadable or without the files'
    sha256, a file missing, cut short or changed since it was published. Reads every byte (file_digest)."""
    folder = Path(folder)
    try:
        recorded = json.loads((folder / MANIFEST).read_text()).get("files")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return f"{folder / MANIFEST} cannot be read"
    if not recorded:
        return f"{folder / MANIFEST} records no sha256 of the files (an export of an older eaglepipe)"
    found = file_digest.problems(folder, recorded)
    return "; ".join(f"{folder}/{p}" for p in found) or None


# The draft's parameters (speculators names) that are the target's, not the draft's: the embedding (every
# engine takes the target's own) and the verifier lm_head/norm the training loss reads. Never trained, never
# exported, never counted as the draft's; the one list export, draft and evaluate use.
TARGET_OWNED = frozenset({"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"})


def draft_owned(tensors: dict) -> dict:
    """The draft's own tensors (what an export ships): all but TARGET_OWNED."""
    return {k: v for k, v in tensors.items() if k not in TARGET_OWNED}


# SGLang target classes whose `set_eagle3_layers_to_capture(ids)` numbers ids in two ways (sglang
# `models/deepseek_v2.py::DeepseekV2ForCausalLM`, 0.5.17 and 0.5.23; DeepseekV3ForCausalLM subclasses it and
# KimiK25ForConditionalGeneration hands the call to its DeepseekV3 language_model): if ids[0] == 1 it captures
# before layers [k + 1] (as llama.py always does), otherwise before layers [k] as given.
SGLANG_FIRST_ID_RULE = frozenset(
    {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"}
)


class AuxIdsUnservable(ValueError):
    pass


def sglang_capture_points(ids: list[int], architecture: str = "") -> list[int]:
    """What SGLang's target class makes of config ids: the loop indices i whose INPUT (= output of layer i-1)
    it captures (`model.layers_to_capture`), replayed from the source named above. The contract tests compare
    this
    with the class itself."""
    if architecture in SGLANG_FIRST_ID_RULE and not (ids and ids[0] == 1):
        return list(ids)
    return [k + 1 for k in ids]


def sglang_layer_ids(ours: list[int], architecture: str = "") -> list[int]:
    """Config ids that make SGLang capture the outputs of our layers `ours` for a target of this
    architecture."""
    if architecture not in SGLANG_FIRST_ID_RULE or (ours and ours[0] == 1):
        return list(ours)
    if ours and ours[0] == 0:
        raise AuxIdsUnservable(
            f"aux layers {list(ours)} cannot be served by SGLang's {architecture}: its "
            "set_eagle3_layers_to_capture "
            "reads a first id of 1 as 'capture after each listed layer' and any other first id as 'capture "
            "before "
            "it', so the output of layer 0 first cannot be asked for; start the aux layers at 1 or later"
        )
    return [k + 1 for k in ours]


def vllm_layer_ids(ours: list[int], architecture: str = "") -> list[int]:
    return [k + 1 for k in ours]  # vLLM's Llama and DeepSeek-V2/V3 models alike: id k = the input of layer k


@dataclass(frozen=True)
class Engine:
    """One serving engine, every fact eaglepipe keeps about it (export, verify, doctor, serve, capture read
    this)."""

    name: str
    version: str  # the release these layouts were read from, and that CI's .venv-engines runs
    supported: tuple[str, str]  # oldest .. newest release eaglepipe ran against (0.5.17: the H200 bundle)
    layer_ids: Callable[[list[int], str], list[int]]  # (eaglepipe aux ids, target architecture) -> engine ids
    verify_module: str  # loads an export into the engine's own class (runs in the engines' Python)
    venv: str = ".venv-engines"  # that Python's virtualenv, under the repo root (scripts/setup_engines.sh)


ENGINES = {
    "sglang": Engine(
        "sglang", "0.5.23", ("0.5.17", "0.5.23"), sglang_layer_ids, "pipeline.engines.sglang_verify"
    ),
    "vllm": Engine("vllm", "0.33.0", ("0.33.0", "0.33.0"), vllm_layer_ids, "pipeline.engines.vllm_verify"),
}
SGLANG_VERSION = ENGINES["sglang"].version


def engine_layer_ids(engine: str, ours: list[int], architecture: str = "") -> list[int]:
    return ENGINES[engine].layer_ids(ours, architecture)


def engine_version(engine: str) -> str:
    """The engine version whose source these layouts were read from."""
    return ENGINES[engine].version


@dataclass(frozen=True)
class DraftArch:
    """One draft layer layout (`train.draft_arch`): the layer's model_type in speculators' config (the trained
    draft's own record of it) and the SGLang class that serves it."""

    name: str
    layer_model_type: str
    sglang_class: str
    sglang_model_type: (
        str  # config.json model_type of the SGLang export (the config class SGLang parses it with)
    )
    engines: tuple[str, ...]  # engines whose own class and loader eaglepipe verifies this layout against


DRAFT_ARCHS = {
    "llama": DraftArch("llama", "llama", "LlamaForCausalLMEagle3", "llama", ("sglang", "vllm")),
    # sglang models/kimi_k25_eagle3.py (0.5.17 and 0.5.23); its model_type deepseek_v3 parses in both (0.5.23
    # also aliases kimi_k2, 0.5.17 does not)
    "mla": DraftArch("mla", "deepseek_v3", "Eagle3DeepseekV2ForCausalLM", "deepseek_v3", ("sglang",)),
}


def draft_arch_of(layer_model_type: str) -> DraftArch:
    """The layout of a trained draft, from its transformer_layer_config.model_type."""
    for a in DRAFT_ARCHS.values():
        if a.layer_model_type == layer_model_type:
            return a
    raise ValueError(f"no draft layout has layer model_type {layer_model_type!r}")


def draft_arch_of_export(config: dict) -> DraftArch:
    """The layout of an SGLang export, from its config.json architectures (Llama's when it names another
    class:
    the checks then report the class)."""
    archs = config.get("architectures") or []
    return next((a for a in DRAFT_ARCHS.values() if [a.sglang_class] == archs), DRAFT_ARCHS["llama"])


def speculators_to_sglang_name(name: str) -> str:
    return "midlayer." + name[len("layers.0.") :] if name.startswith("layers.0.") else name


def draft_kv_bytes_per_token(config: dict, dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token costs the served draft (one layer, bf16): MLA caches one latent + one rope key
    (kv_lora + rope) shared by all heads; GQA caches K and V per KV head."""
    if draft_arch_of_export(config).name == "mla":
        return (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * dtype_bytes
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_key_value_heads"] * head_dim * dtype_bytes


def tensor_table(tensors: dict[str, torch.Tensor]) -> list[dict]:
    """Per-tensor statistics that show an unloaded or broken weight: std, L2 norm, abs max, finiteness.
    (Not the mean: a bf16 weight's mean prints 0.000000 whether it is loaded or not.)"""
    rows = []
    for name, t in sorted(tensors.items()):
        f = t.float() if t.is_floating_point() else t.double()
        rows.append(
            {
                "name": name,
                "shape": list(t.shape),
                "dtype": str(t.dtype).replace("torch.", ""),
                "std": float(f.std()) if f.numel() > 1 else 0.0,
                "norm": float(f.norm()),
                "absmax": float(f.abs().max()) if f.numel() else 0.0,
                "finite": bool(torch.isfinite(f).all()),
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'tensor':<44}{'shape':<18}{'dtype':<9}{'std':>11}{'norm':>12}{'absmax':>10}"]
    for r in rows:
        lines.append(
            f"{r['name']:<44}{str(tuple(r['shape'])):<18}{r['dtype']:<9}{r['std']:>11.4g}"
            f"{r['norm']:>12.4g}{r['absmax']:>10.4g}{'' if r['finite'] else '  NON-FINITE'}"
        )
    return "\n".join(lines)


def is_dead(row: dict) -> bool:
    """A float weight that is all zeros (or constant) carries nothing: fc zeroed, a layer never loaded."""
    return (
        row["dtype"].startswith(("bfloat", "float"))
        and row["norm"] == 0.0
        or (
            row["dtype"].startswith(("bfloat", "float"))
            and math.prod(row["shape"]) > 1
            and row["std"] == 0.0
            and not row["name"].endswith(("norm.weight", "layernorm.weight"))
        )
    )


SGLANG_CONFIG_KEYS = {  # the layer config keys the SGLang class of each layout reads
    "llama": (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "rope_parameters",
        "hidden_act",
        "attention_bias",
        "bos_token_id",
        "eos_token_id",
    ),
    "mla": (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "rope_parameters",
        "rope_interleave",
        "hidden_act",
        "attention_bias",
        "bos_token_id",
        "eos_token_id",
    ),
}


def sglang_config(
    layer: dict,
    draft_cfg: dict,
    vocab_size: int,
    target_hidden: int,
    aux_ids: list[int],
    layout: DraftArch = DRAFT_ARCHS["llama"],
) -> dict:
    """config.json of the SGLang export: the layout's class, the layer keys it reads, the aux ids in SGLang's
    numbering (export stage; train builds the same in memory for tau during training)."""
    keep = SGLANG_CONFIG_KEYS[layout.name]
    rope = layer.get("rope_parameters") or {}
    return {
        "architectures": [layout.sglang_class],
        "model_type": layout.sglang_model_type,
        **{k: layer[k] for k in keep if k in layer},
        "rope_theta": rope.get("rope_theta", 10000.0),
        "vocab_size": int(vocab_size),
        "draft_vocab_size": int(draft_cfg["draft_vocab_size"]),
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "target_hidden_size": int(target_hidden),
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True},
    }


def sglang_tensors(weights: dict) -> dict:
    """speculators' draft-owned tensors under SGLang's parameter names (what the export writes)."""
    return {speculators_to_sglang_name(k): v for k, v in draft_owned(weights).items()}


def read_sglang(folder) -> tuple[dict, dict]:
    """An SGLang export's (tensors, config.json), as evaluate reads them: a file that cannot be read, or
    tensors in another layout than `sglang_tensors` writes (vLLM's `layers.0.*`), is one line naming it and
    the fix."""
    folder = Path(folder)
    fix = f"export it again: delete {folder} and rerun stage=export"
    config = faults.read_json(folder / "config.json", fix)
    tensors = faults.load_safetensors(folder / "model.safetensors", fix)
    if not any(k.startswith("midlayer.") for k in tensors):
        layout = "vLLM / speculators" if any(k.startswith("layers.0.") for k in tensors) else "an unknown"
        raise UserError(
            f"{folder / 'model.safetensors'}: its layer is not named midlayer.* (the SGLang layout evaluate "
            f"reads) but {'layers.0.*' if layout[0] == 'v' else 'otherwise'} ({layout} layout): {fix}"
        )
    return tensors, config
