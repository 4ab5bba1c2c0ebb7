"""Draft vocabulary: d2t offsets and the t2d mask (docs/conventions.md#d2t). Pure module.

    vocab/
      vocab.safetensors   d2t int64 [draft_vocab]  (target_id = draft_id + d2t[draft_id])
                          t2d bool  [target_vocab] (true exactly at the used target ids)
      token_freq.npy      int64 [target_vocab]     supervised-token counts it was built from
      manifest.json       schema, sizes, features manifest hash, coverage, producer

Invariants, checked when written and whenever loaded (`validate`): len(d2t) == draft vocab; i + d2t[i]
strictly increasing and inside [0, V); t2d.sum() == draft vocab; t2d true exactly at i + d2t[i]. An
absolute-id table (d2t[i] = target id) breaks the last one and is rejected.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from pipeline.formats import faults
from pipeline.lazy_compile import compile_deferred

SCHEMA_VERSION = 1
FORMAT = "eaglepipe-vocab"


class VocabError(Exception):
    """A d2t/t2d pair that breaks the offset-table invariants."""


MANIFEST = "manifest.json"  # written last: its presence means the vocab is complete
REPORT = "report.json"  # the vocab stage's coverage report
MAPPING = ("d2t", "t2d")  # the draft's vocabulary-mapping tensors, beside its weights


def full(draft_vocab_size: int, target_vocab_size: int) -> bool:
    """A draft over the whole target vocabulary (TorchSpec trains Kimi drafts so): draft id = target id, and
    the draft's weights carry no d2t/t2d. speculators registers none (`use_draft_vocab` False); SGLang reads
    none (llama_eagle3 / kimi_k25_eagle3: d2t "absent in checkpoints whose draft_vocab_size equals
    vocab_size", hot_token_id stays None); vLLM builds no `draft_id_to_target_id` and its loader has nowhere
    to put a d2t. vocab/ still holds the identity map (d2t all 0, t2d all true), as for any size."""
    return draft_vocab_size == target_vocab_size


def matches(weights: dict, d2t: torch.Tensor, t2d: torch.Tensor) -> bool:
    """Whether a trained draft's weights carry this vocabulary: its d2t/t2d, or none if it is `full`."""
    if full(len(d2t), len(t2d)):
        return not any(k in weights for k in MAPPING)
    return all(k in weights for k in MAPPING) and (
        torch.equal(weights["d2t"], d2t) and torch.equal(weights["t2d"], t2d)
    )


# The draft vocabulary sizes compared beside vocab.draft_vocab_size and the full vocabulary: the vocab stage's
# coverage table and `eaglepipe plan`'s memory table (at 150K+ targets the head and the loss grow with it)
COMPARED_SIZES = (8192, 16384, 32768, 65536)


def coverage_by_size(freq: np.ndarray, sizes) -> dict[int, float]:
    """The share of supervised tokens the `k` most counted ids cover, for each k of `sizes` (k >= the
    vocabulary: all of them)."""
    cum = np.cumsum(np.sort(freq)[::-1])
    total = max(int(cum[-1]), 1)
    return {int(k): float(cum[min(int(k), len(freq)) - 1] / total) for k in sizes}


def heldout_coverage_by_size(fit: np.ndarray, held: np.ndarray, sizes) -> dict[int, float]:
    """The share of `held`'s supervised tokens covered by the `k` ids most counted in `fit` (other samples):
    what a draft vocabulary chosen on the training data covers of data it was not chosen on."""
    cum = np.cumsum(held[np.argsort(-fit, kind="stable")])
    total = max(int(cum[-1]), 1)
    return {int(k): float(cum[min(int(k), len(fit)) - 1] / total) for k in sizes}


def smallest_covering(freq: np.ndarray, share: float) -> int:
    """The fewest ids that cover `share` of the supervised tokens."""
    cum = np.cumsum(np.sort(freq)[::-1])
    return int(np.searchsorted(cum, share * cum[-1]) + 1)


def build(freq: np.ndarray, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Top-`draft_vocab_size` ids by count (ties: lower id first), padded with the lowest unused ids when
    fewer were seen (speculators' rule). Returns (d2t, t2d, number of padded ids)."""
    with compile_deferred():
        from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    seen = {int(i): int(freq[i]) for i in np.flatnonzero(freq)}
    d2t, t2d = build_vocab_mappings_from_distribution(seen, draft_vocab_size, len(freq))
    validate(d2t, t2d, len(freq), draft_vocab_size)
    return d2t, t2d, max(0, draft_vocab_size - len(seen))


def validate(
    d2t: torch.Tensor, t2d: torch.Tensor, target_vocab_size: int, draft_vocab_size: int | None = None
) -> None:
    problems = []
    if d2t.dtype != torch.int64 or d2t.ndim != 1:
        problems.append(f"d2t must be 1-D int64, got {tuple(d2t.shape)} {d2t.dtype}")
    if t2d.dtype != torch.bool or t2d.shape != (target_vocab_size,):
        problems.append(f"t2d must be bool [{target_vocab_size}], got {tuple(t2d.shape)} {t2d.dtype}")
    if draft_vocab_size is not None and d2t.shape[0] != draft_vocab_size:
        problems.append(f"len(d2t)={d2t.shape[0]} != draft vocab {draft_vocab_size}")
    if problems:
        raise VocabError("; ".join(problems))
    if t2d.any() and d2t.shape[0] == int(t2d.sum()) and torch.equal(d2t, torch.nonzero(t2d).flatten()):
        raise VocabError(
            "d2t holds absolute target ids (d2t[i] = the i-th draft token's target id); engines "
            "compute target = i + d2t[i], so d2t must hold offsets: d2t[i] = target_id - i"
        )
    target = torch.arange(d2t.shape[0]) + d2t
    if not bool((target[1:] > target[:-1]).all()):
        problems.append("i + d2t[i] is not strictly increasing")
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= target_vocab_size):
        problems.append(f"i + d2t[i] leaves [0, {target_vocab_size})")
    if int(t2d.sum()) != d2t.shape[0]:
        problems.append(f"t2d.sum()={int(t2d.sum())} != len(d2t)={d2t.shape[0]}")
    ok = target.clamp(0, target_vocab_size - 1)
    if not problems and not bool(t2d[ok].all()):
        problems.append("t2d is not true at i + d2t[i]: d2t looks like absolute target ids, not offsets")
    if problems:
        raise VocabError("; ".join(problems))


def save(out: Path, d2t: torch.Tensor, t2d: torch.Tensor, freq: np.ndarray, info: dict) -> None:
    validate(d2t, t2d, len(freq))
    out.mkdir(parents=True, exist_ok=True)
    save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(out / "vocab.safetensors"))
    np.save(out / "token_freq.npy", freq.astype(np.int64))
    manifest = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "draft_vocab_size": int(d2t.shape[0]),
        "target_vocab_size": len(freq),
        "d2t_semantics": "target_id = draft_id + d2t[draft_id]",
        **info,
    }
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, out / MANIFEST)  # written last: its presence means complete


def load(out: Path) -> tuple[torch.Tensor, torch.Tensor, dict]:
    out = Path(out)
    if not (out / MANIFEST).is_file():
        raise VocabError(f"no draft vocabulary at {out}")
    fix = f"delete {out} and rerun stage=vocab (it builds it again from the feature store)"
    manifest = faults.read_json(out / MANIFEST, fix)
    if manifest.get("format") != FORMAT or manifest.get("schema_version") != SCHEMA_VERSION:
        raise VocabError(f"{out}: not an {FORMAT} schema {SCHEMA_VERSION} folder")
    tensors = faults.load_safetensors(out / "vocab.safetensors", fix)
    if missing := [k for k in ("d2t", "t2d") if k not in tensors]:
        raise faults.damaged(out / "vocab.safetensors", fix, f"no {' or '.join(missing)} in it")
    try:  # held when it was written: a changed byte breaks the offset table
        validate(tensors["d2t"], tensors["t2d"], manifest["target_vocab_size"], manifest["draft_vocab_size"])
    except VocabError as e:
        raise faults.damaged(out / "vocab.safetensors", fix, str(e)) from None
    return tensors["d2t"], tensors["t2d"], manifest
