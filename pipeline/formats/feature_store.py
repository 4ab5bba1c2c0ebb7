"""The feature store: aux/last hidden states of the target, one zarr v3 group per shard.

Layout (docs/feature_store.md is the normative description):

    features/
      manifest.json          # {"schema_version", "facts": {...}, "shards": [{name, sample_start, ...}]}
      shard-00000.zarr/      # zarr v3 group; attributes = facts + this shard's sample range
        input_ids   int32  [T]
        loss_mask   uint8  [T]
        offsets     int64  [N+1]     sample i = tokens offsets[i]:offsets[i+1]
        aux_hidden  uint16 [T, n_aux*H]   bf16 bit patterns (attribute logical_dtype = "bfloat16")
        last_hidden uint16 [T, H]         bf16 bit patterns, PRE-norm output of the last decoder layer

A shard is written as `shard-XXXXX.zarr.tmp`, renamed when complete, and only then entered in the manifest
(itself replaced atomically). A reader trusts the manifest alone, so a killed writer never leaves a shard
that looks complete. Pure module: no Hydra, no globals.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec, BloscShuffle

SCHEMA_VERSION = 1
FORMAT = "eaglepipe-features"
LOGICAL_DTYPE = "bfloat16"
STORAGE_DTYPE = "uint16"
MANIFEST = "manifest.json"


class StoreError(Exception):
    """The store on disk does not match what the caller expects (stages turn this into a UserError)."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.zarr"


def bf16_to_bits(t: torch.Tensor) -> np.ndarray:
    """bf16 tensor -> uint16 numpy array of the same bit patterns (bit-exact, no rounding)."""
    if t.dtype != torch.bfloat16:
        raise TypeError(f"expected a bfloat16 tensor, got {t.dtype}")
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def bits_to_bf16(a: np.ndarray) -> torch.Tensor:
    """uint16 numpy array of bf16 bit patterns -> bf16 tensor (bit-exact)."""
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)


def make_compressors(name: str, clevel: int = 3) -> Optional[list]:
    if name == "none":
        return None
    cname = {"blosc_zstd": "zstd", "blosc_lz4": "lz4"}.get(name)
    if cname is None:
        raise ValueError(f"unknown compressor {name!r}; expected blosc_zstd, blosc_lz4 or none")
    return [BloscCodec(cname=cname, clevel=clevel, shuffle=BloscShuffle.bitshuffle)]


# ----------------------------------------------------------------------------------------------- manifest
def read_manifest(root: Path) -> Optional[dict]:
    path = Path(root) / MANIFEST
    if not path.exists():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("schema_version") != SCHEMA_VERSION:
        raise StoreError(
            f"{path}: format {manifest.get('format')!r} schema {manifest.get('schema_version')!r}; "
            f"this eaglepipe reads {FORMAT!r} schema {SCHEMA_VERSION}"
        )
    return manifest


def write_manifest(root: Path, manifest: dict) -> None:
    path = Path(root) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, path)


def open_for_writing(root: Path, facts: dict, overwrite: bool = False) -> dict:
    """Create or reopen a store for `facts`; returns the manifest. Cleans uncommitted leftovers.

    Raises StoreError when the store holds features made from different facts (unless overwrite).
    """
    root = Path(root)
    facts = json.loads(json.dumps(facts))  # normalise tuples etc. to what JSON gives back
    manifest = read_manifest(root) if root.exists() else None
    if manifest is not None and manifest["facts"] != facts:
        if not overwrite:
            diff = sorted(k for k in set(facts) | set(manifest["facts"]) if facts.get(k) != manifest["facts"].get(k))
            shown = ", ".join(f"{k}: store={manifest['facts'].get(k)!r} asked={facts.get(k)!r}" for k in diff[:4])
            raise StoreError(f"{root} holds features made from other inputs ({shown})")
        shutil.rmtree(root)
        manifest = None
    root.mkdir(parents=True, exist_ok=True)
    if manifest is None:
        manifest = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "facts": facts, "shards": []}
        write_manifest(root, manifest)
    committed = {s["name"] for s in manifest["shards"]}
    for entry in root.iterdir():  # a shard renamed but not yet in the manifest, or a .tmp: not complete
        if entry.is_dir() and entry.name.startswith("shard-") and entry.name not in committed:
            shutil.rmtree(entry)
    return manifest


# ------------------------------------------------------------------------------------------------- writer
@dataclass
class ShardSpec:
    index: int
    sample_start: int  # global sample index, inclusive
    lengths: list[int]  # token count of each sample in the shard, in order

    @property
    def sample_end(self) -> int:
        return self.sample_start + len(self.lengths)


class ShardWriter:
    """Writes one shard under a temporary name; `commit()` renames it and enters it in the manifest.

    Samples arrive in any order (extract batches by length), so they are gathered in a host buffer and
    written once, chunk-aligned, at commit: writing samples straight into compressed chunks would decode
    and re-encode each chunk once per sample it holds. Memory = shard tokens x (n_aux+1) x H x 2 bytes.
    """

    def __init__(self, root: Path, spec: ShardSpec, facts: dict, widths: tuple[int, int],
                 chunk_tokens: int = 2048, compressor: str = "blosc_zstd", clevel: int = 3):
        self.root, self.spec, self.facts = Path(root), spec, facts
        self.final = self.root / shard_name(spec.index)
        self.tmp = self.root / (shard_name(spec.index) + ".tmp")
        self.offsets = np.zeros(len(spec.lengths) + 1, dtype=np.int64)
        np.cumsum(spec.lengths, out=self.offsets[1:])
        total = int(self.offsets[-1])
        self.chunk, self.compressors = max(1, min(chunk_tokens, total)), make_compressors(compressor, clevel)
        self.buffers = {"input_ids": np.zeros(total, np.int32), "loss_mask": np.zeros(total, np.uint8),
                        "aux_hidden": np.zeros((total, widths[0]), np.uint16),
                        "last_hidden": np.zeros((total, widths[1]), np.uint16)}
        self.written = np.zeros(len(spec.lengths), dtype=bool)

    def write(self, local_index: int, input_ids: np.ndarray, loss_mask: np.ndarray,
              aux_hidden: torch.Tensor, last_hidden: torch.Tensor) -> None:
        a, b = int(self.offsets[local_index]), int(self.offsets[local_index + 1])
        n = b - a
        if not (len(input_ids) == len(loss_mask) == aux_hidden.shape[0] == last_hidden.shape[0] == n):
            raise ValueError(f"sample {self.spec.sample_start + local_index}: lengths disagree with the plan ({n})")
        self.buffers["input_ids"][a:b] = input_ids
        self.buffers["loss_mask"][a:b] = loss_mask
        self.buffers["aux_hidden"][a:b] = bf16_to_bits(aux_hidden)
        self.buffers["last_hidden"][a:b] = bf16_to_bits(last_hidden)
        self.written[local_index] = True

    def commit(self, manifest: dict) -> None:
        missing = np.flatnonzero(~self.written)
        if len(missing):
            raise RuntimeError(f"shard {self.spec.index}: {len(missing)} samples never written")
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        group = zarr.open_group(str(self.tmp), mode="w", zarr_format=3)
        group.attrs.update({**self.facts, "sample_range": [self.spec.sample_start, self.spec.sample_end],
                            "num_tokens": int(self.offsets[-1]), "shard_index": self.spec.index})
        for name, data in self.buffers.items():
            arr = group.create_array(name, shape=data.shape, chunks=(self.chunk, *data.shape[1:]), dtype=data.dtype,
                                     compressors=self.compressors, fill_value=0)
            if data.ndim == 2:
                arr.attrs.update({"logical_dtype": LOGICAL_DTYPE, "storage_dtype": STORAGE_DTYPE})
            arr[...] = data
        group.create_array("offsets", data=self.offsets, compressors=None)
        os.replace(self.tmp, self.final)
        manifest["shards"].append({"name": self.final.name, "sample_start": self.spec.sample_start,
                                   "sample_end": self.spec.sample_end, "num_tokens": int(self.offsets[-1])})
        manifest["shards"].sort(key=lambda s: s["sample_start"])
        write_manifest(self.root, manifest)
        self.buffers.clear()


# ------------------------------------------------------------------------------------------------- reader
class FeatureStore:
    """Read-only view over the committed shards of a store."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        manifest = read_manifest(self.root)
        if manifest is None:
            raise StoreError(f"no feature store at {self.root} (no {MANIFEST})")
        self.manifest = manifest
        self.facts: dict = manifest["facts"]
        self.shards = manifest["shards"]
        self._groups: dict[str, Any] = {}
        self._offsets: dict[str, np.ndarray] = {}
        expected = 0
        for s in self.shards:
            if s["sample_start"] != expected:
                raise StoreError(f"{self.root}: shards are not contiguous at sample {expected}")
            expected = s["sample_end"]
        self.num_samples = expected

    def __len__(self) -> int:
        return self.num_samples

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.facts["aux_layer_ids"])

    @property
    def hidden_size(self) -> int:
        return int(self.facts["hidden_size"])

    def _group(self, name: str):
        if name not in self._groups:
            g = zarr.open_group(str(self.root / name), mode="r")
            self._groups[name] = g
            self._offsets[name] = g["offsets"][:]
        return self._groups[name], self._offsets[name]

    def _locate(self, index: int) -> tuple[dict, int]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} outside [0, {self.num_samples})")
        lo, hi = 0, len(self.shards) - 1
        while lo < hi:  # binary search over contiguous sample ranges
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.shards[mid]["sample_start"] <= index else (lo, mid - 1)
        shard = self.shards[lo]
        return shard, index - shard["sample_start"]

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """One sample: input_ids int64 [n], loss_mask uint8 [n], aux_hidden/last_hidden bf16 [n, *]."""
        shard, local = self._locate(index)
        group, offsets = self._group(shard["name"])
        a, b = int(offsets[local]), int(offsets[local + 1])
        return self._slice(group, a, b)

    def sample_lengths(self) -> np.ndarray:
        return np.concatenate([np.diff(self._group(s["name"])[1]) for s in self.shards]) if self.shards \
            else np.zeros(0, dtype=np.int64)

    def iter_tokens(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(input_ids, loss_mask) of each shard, without reading hidden states."""
        for s in self.shards:
            group, _ = self._group(s["name"])
            yield group["input_ids"][:], group["loss_mask"][:]

    def manifest_hash(self) -> str:
        import hashlib
        return hashlib.sha256((self.root / MANIFEST).read_bytes()).hexdigest()[:16]

    @staticmethod
    def _slice(group, a: int, b: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.from_numpy(group["input_ids"][a:b].astype(np.int64)),
            "loss_mask": torch.from_numpy(group["loss_mask"][a:b]),
            "aux_hidden": bits_to_bf16(group["aux_hidden"][a:b]),
            "last_hidden": bits_to_bf16(group["last_hidden"][a:b]),
        }

    def iter_token_ranges(self, tokens: int) -> Iterator[tuple[str, int, dict[str, torch.Tensor]]]:
        """Stream every token of the store in ranges of at most `tokens` (never crossing a shard)."""
        for s in self.shards:
            group, offsets = self._group(s["name"])
            total = int(offsets[-1])
            for a in range(0, total, tokens):
                yield s["name"], a, self._slice(group, a, min(a + tokens, total))
