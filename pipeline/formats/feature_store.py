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
      (store_dtype fp8_e4m3: aux_hidden / last_hidden are uint8 float8_e4m3fn bit patterns, with
        aux_scale   float32 [T, n_aux]   last_scale float32 [T, 1]   value = fp8 x scale, per token and layer)

A shard is written as `shard-XXXXX.zarr.tmp`, renamed when complete, and only then entered in the manifest
(itself replaced atomically). A reader trusts the manifest alone, so a killed writer never leaves a shard
that looks complete. Every chunk ends with a crc32c of its encoded bytes (zarr's own `crc32c` codec, last
in each array's codec chain; every chunk is written, even an all-zero one), so a flipped bit, a truncated
chunk or a missing chunk file stops the reader (ChunkError) instead of feeding changed values to training;
store_check.py checks every chunk, and rebuilds a damaged manifest from the shards. Pure module: no Hydra, no
globals.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

SCHEMA_VERSION = 2  # 2: every chunk carries a crc32c (schema 1 had none)
CHECKSUM = "crc32c"  # per chunk, zarr v3 codec, recorded in the manifest
FORMAT = "eaglepipe-features"
LOGICAL_DTYPE = "bfloat16"
STORAGE_DTYPE = "uint16"
FP8 = "fp8_e4m3"  # facts["store_dtype"]; absent = bf16 (stores written before fp8 existed keep their facts)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALES = ("aux_scale", "last_scale")
# chunk length of the 1-D arrays (input_ids, loss_mask): 64 KB of ids, decoded beside a 2 MB states chunk by a
# sample read; a 262,144-token shard has 16 files of each instead of 512 (every file costs its writer ~0.6 ms)
ID_CHUNK_TOKENS = 16384
MANIFEST = "manifest.json"
LOCK = ".manifest.lock"  # held while the manifest is read, changed and replaced (several writer processes)
ARRAYS = ("input_ids", "loss_mask", "offsets", "aux_hidden", "last_hidden")
SHARD_KEYS = {"name", "sample_start", "sample_end", "num_tokens"}  # a shard's entry in the manifest
# what zarr raises on a damaged zarr.json (cut short, emptied, other keys): json.JSONDecodeError and its
# MetadataValidationError are ValueErrors; a missing key, a wrong node type, null
METADATA_ERRORS = (OSError, ValueError, TypeError, KeyError, AttributeError)


class StoreError(Exception):
    """The store on disk does not match what the caller expects (stages turn this into a UserError)."""


class Damaged(StoreError):
    """A file of the store is damaged: the message names it and the fix, and is said as it is (one line)."""


class ManifestDamaged(Damaged):
    """manifest.json cannot be read (cut short, emptied, not its shape): `extract.repair=true` rebuilds it."""

    def __init__(self, path: Path, what: str):
        self.path, self.what, run_dir = path, what, Path(path).parent.parent
        super().__init__(
            f"{path} is damaged ({what}): rebuild it from the shards that verify with `eaglepipe "
            f"stage=extract extract.repair=true run_dir={run_dir}` plus the run's own overrides (it extracts "
            f"the others again); `eaglepipe check-store run_dir={run_dir}` lists them"
        )


class ChunkError(Damaged):
    """A committed chunk (or a shard's metadata) is damaged, truncated or missing: its shard must be extracted
    again."""

    def __init__(self, root: Path, shard: str, array: str, what: str):
        self.shard, self.array, self.what = shard, array, what
        super().__init__(
            f"feature store {root}: {shard}/{array}: {what}; re-extract the damaged shards with "
            f"`eaglepipe stage=extract extract.repair=true run_dir={Path(root).parent}` (plus the "
            f"run's own overrides), `eaglepipe check-store run_dir=...` lists every damaged chunk"
        )


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


def store_dtype(facts: dict) -> str:
    return facts.get("store_dtype", "bf16")


def arrays(facts: dict) -> tuple[str, ...]:
    return ARRAYS + (SCALES if store_dtype(facts) == FP8 else ())


def encode_fp8(
    x: torch.Tensor, groups: int, chunk_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, groups*H] -> (uint8 [N, groups*H] float8_e4m3fn bits, float32 [N, groups] scales), on x's device.
    Each token's each layer is scaled so its largest |value| is e4m3's largest finite value (448): relative
    rounding error <= 2^-4 per element (3 mantissa bits), smaller magnitudes down to e4m3's subnormals.
    Encoded chunk_rows tokens at a time (default: ~256 MB of fp32 working copy), so a capture batch at
    Kimi-K2.5's shape (64K tokens x 3 x 7168) needs a chunk's fp32 copies on the GPU, not two of the whole
    batch's 5.6
    GB."""
    n, width = x.shape
    if width % groups:
        raise ValueError(f"encode_fp8: width {width} is not {groups} equal groups")
    rows = chunk_rows or max(1, 2**26 // max(width, 1))
    bits = torch.empty(n, width, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n, groups, dtype=torch.float32, device=x.device)
    for a in range(0, n, rows):
        g = x[a : a + rows].float().reshape(-1, groups, width // groups)
        scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-30) / FP8_MAX
        bits[a : a + rows] = (g / scale).to(torch.float8_e4m3fn).reshape(-1, width).view(torch.uint8)
        scales[a : a + rows] = scale.squeeze(-1)
    return bits, scales


# float8_e4m3fn bit pattern -> its exact float32 value. A gather through it is 3.5x faster on CPU than torch's
# float8 -> float32 cast, and the same values (the loader decodes every fp8 state:
# scripts/bench/loader_read.py)
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def decode_fp8(bits: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """Inverse of encode_fp8: uint8 [N, groups*H] + float32 [N, groups] -> bf16 [N, groups*H] (the fp32
    product
    of the e4m3 value and its scale, rounded to bf16)."""
    n, groups = scale.shape
    q = _FP8_VALUES[bits].reshape(n, groups, -1)
    q *= np.asarray(scale, dtype=np.float32)[:, :, None]
    return torch.from_numpy(q.reshape(n, -1)).bfloat16()


# ----------------------------------------------------------------------------------------------- manifest
def read_manifest(root: Path) -> dict | None:
    path = Path(root) / MANIFEST
    if Path(root).exists() and not Path(root).is_dir():
        raise Damaged(
            f"{root} is a file, not a directory: the feature store is a folder; move the file away (or "
            "delete it) and run stage=extract"
        )
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # cut short, emptied, not text (JSONDecodeError, UnicodeDecodeError)
        raise ManifestDamaged(path, f"{type(e).__name__}: {e}") from None
    if not isinstance(manifest, dict):
        raise ManifestDamaged(path, f"a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") == FORMAT and manifest.get("schema_version") == 1:
        raise StoreError(
            f"{path}: schema 1, written by an eaglepipe before chunk checksums; this eaglepipe reads "
            f"schema {SCHEMA_VERSION} (crc32c per chunk): extract it again (extract.overwrite=true)"
        )
    if manifest.get("format") != FORMAT or manifest.get("schema_version") != SCHEMA_VERSION:
        raise StoreError(
            f"{path}: format {manifest.get('format')!r} schema {manifest.get('schema_version')!r}; "
            f"this eaglepipe reads {FORMAT!r} schema {SCHEMA_VERSION}"
        )
    entries = manifest.get("shards")
    if not isinstance(manifest.get("facts"), dict) or not (
        isinstance(entries, list) and all(isinstance(s, dict) and SHARD_KEYS <= set(s) for s in entries)
    ):
        raise ManifestDamaged(path, "its facts or its shard list are not what extract writes")
    return manifest


def write_manifest(root: Path, manifest: dict) -> None:
    path = Path(root) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, path)


_THREADS = (
    threading.Lock()
)  # flock is per process on NFS (Linux maps it to fcntl locks): threads take this first


@contextmanager
def manifest_lock(root: Path):
    """An exclusive lock on the store's manifest (flock on a file beside it): writers in several processes
    (data-parallel extract) and threads (extract.write_workers) read-modify-replace the manifest one at a
    time.
    A writer killed while holding it releases it with its process."""
    with _THREADS, open(Path(root) / LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ------------------------------------------------------------------------------------------------- reader
class FactsView:
    """What a source of states says about itself, read from its `facts` (the store and the online source)."""

    facts: dict

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.facts["aux_layer_ids"])

    @property
    def hidden_size(self) -> int:
        return int(self.facts["hidden_size"])


class FeatureStore(FactsView):
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

    def _group(self, name: str):
        if name not in self._groups:
            # the array handles, opened once: opening one parses its metadata (~1 ms, 20% of a loader's read
            # time when it happened per read: scripts/bench/loader_read.py)
            g, handles = open_group(self.root, name), {}
            for array in arrays(self.facts):
                try:
                    handles[array] = g[array]
                except METADATA_ERRORS as e:
                    raise ChunkError(self.root, name, array, metadata_problem(e)) from None
                if missing := missing_chunks(self.root / name, g, array):
                    raise ChunkError(
                        self.root, name, array, f"{len(missing)} chunk file(s) missing ({missing[0]})"
                    )
            self._groups[name] = handles
            self._offsets[name] = _read(self.root, name, g, "offsets", slice(None))
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
        return self._slice(shard["name"], group, a, b)

    def tokens(self, index: int) -> dict[str, torch.Tensor]:
        """One sample's input_ids (int64) and loss_mask (uint8), without reading its hidden states."""
        shard, local = self._locate(index)
        group, offsets = self._group(shard["name"])
        rows = slice(int(offsets[local]), int(offsets[local + 1]))
        return {
            "input_ids": torch.from_numpy(
                _read(self.root, shard["name"], group, "input_ids", rows).astype(np.int64)
            ),
            "loss_mask": torch.from_numpy(_read(self.root, shard["name"], group, "loss_mask", rows)),
        }

    def sample_lengths(self) -> np.ndarray:
        return (
            np.concatenate([np.diff(self._group(s["name"])[1]) for s in self.shards])
            if self.shards
            else np.zeros(0, dtype=np.int64)
        )

    def iter_tokens(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(input_ids, loss_mask) of each shard, without reading hidden states."""
        for s in self.shards:
            group, _ = self._group(s["name"])
            yield (
                _read(self.root, s["name"], group, "input_ids", slice(None)),
                _read(self.root, s["name"], group, "loss_mask", slice(None)),
            )

    def manifest_hash(self) -> str:
        import hashlib

        return hashlib.sha256((self.root / MANIFEST).read_bytes()).hexdigest()[:16]

    def _slice(self, shard: str, group, a: int, b: int) -> dict[str, torch.Tensor]:
        def read(array):
            return _read(self.root, shard, group, array, slice(a, b))

        if store_dtype(self.facts) == FP8:
            aux, last = (decode_fp8(read(f"{n}_hidden"), read(f"{n}_scale")) for n in ("aux", "last"))
        else:
            aux, last = bits_to_bf16(read("aux_hidden")), bits_to_bf16(read("last_hidden"))
        return {
            "input_ids": torch.from_numpy(read("input_ids").astype(np.int64)),
            "loss_mask": torch.from_numpy(read("loss_mask")),
            "aux_hidden": aux,
            "last_hidden": last,
        }

    def iter_token_ranges(self, tokens: int) -> Iterator[tuple[str, int, dict[str, torch.Tensor]]]:
        """Stream every token of the store in ranges of at most `tokens` (never crossing a shard)."""
        for s in self.shards:
            group, offsets = self._group(s["name"])
            total = int(offsets[-1])
            for a in range(0, total, tokens):
                yield s["name"], a, self._slice(s["name"], group, a, min(a + tokens, total))


# ------------------------------------------------------------------------------------------------ checksums
def _read(root: Path, shard: str, group, array: str, rows: slice) -> np.ndarray:
    """group[array][rows]; a chunk whose crc32c (or decompression) fails is a ChunkError naming it."""
    arr = group[array]
    try:
        return arr[rows]
    except (ValueError, RuntimeError) as e:  # crc32c: ValueError "checksum do not match"; Blosc: RuntimeError
        start, stop, _ = rows.indices(arr.shape[0])
        n = arr.chunks[0]
        bad = [i for i in range(start // n, (stop - 1) // n + 1) if chunk_fails(arr, i)]
        raise ChunkError(
            root,
            shard,
            array,
            f"chunk {', '.join(map(str, bad)) or '?'} fails its {CHECKSUM} check "
            f"(damaged or truncated: {type(e).__name__})",
        ) from None


def chunk_fails(arr, i: int) -> bool:
    try:
        arr[i * arr.chunks[0] : (i + 1) * arr.chunks[0]]
        return False
    except (ValueError, RuntimeError):
        return True


def missing_chunks(shard_dir: Path, group, array: str) -> list[str]:
    """Chunk files of `array` that should exist (every chunk is written) but do not."""
    arr = group[array]
    keys = (arr.metadata.encode_chunk_key((i,) + (0,) * (arr.ndim - 1)) for i in range(arr.cdata_shape[0]))
    return [f"{array}/{k}" for k in keys if not (Path(shard_dir) / array / k).is_file()]


def metadata_problem(e: BaseException) -> str:
    """What a METADATA_ERRORS exception of opening a shard's group or array says about its zarr.json."""
    if isinstance(e, KeyError):
        return "array missing (no zarr.json)"
    return f"zarr.json cannot be read ({type(e).__name__}: {' '.join(str(e).split())[:160]})"


def open_group(root: Path, name: str):
    """A committed shard's zarr group; its zarr.json damaged or gone is a ChunkError naming the shard."""
    try:
        return zarr.open_group(str(Path(root) / name), mode="r")
    except METADATA_ERRORS as e:
        raise ChunkError(Path(root), name, "(group)", metadata_problem(e)) from None
