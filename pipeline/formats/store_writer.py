"""Writing the feature store (docs/feature_store.md, writing protocol): a store opened or resumed, a shard's
buffers filled sample by sample and committed atomically (every chunk crc32c-checksummed, encoded by
zarr-python or tensorstore, byte for byte the same), the manifest updated under its lock. Reading and
checking a store: feature_store.py."""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec, BloscShuffle, Crc32cCodec

from pipeline.formats import shard_regions
from pipeline.formats.feature_store import (
    CHECKSUM,
    FORMAT,
    FP8,
    ID_CHUNK_TOKENS,
    LOGICAL_DTYPE,
    SCHEMA_VERSION,
    StoreError,
    bf16_to_bits,
    manifest_lock,
    read_manifest,
    shard_name,
    store_dtype,
    write_manifest,
)
from pipeline.formats.shard_regions import (
    ALL_CHUNKS,  # an all-zero chunk is written too: a missing file is damage
)


def make_compressors(name: str, clevel: int = 3) -> list:
    """The bytes-to-bytes codecs of every array: the compressor (if any), then the chunk's crc32c."""
    if name == "none":
        return [Crc32cCodec()]
    cname = {"blosc_zstd": "zstd", "blosc_lz4": "lz4"}.get(name)
    if cname is None:
        raise ValueError(f"unknown compressor {name!r}; expected blosc_zstd, blosc_lz4 or none")
    return [BloscCodec(cname=cname, clevel=clevel, shuffle=BloscShuffle.bitshuffle), Crc32cCodec()]


def add_shard(root: Path, entry: dict, into: dict | None = None) -> dict:
    """Enter one committed shard in the manifest ON DISK, under the lock, and return that manifest: a shard
    committed by another process or thread in the meantime is kept, the list stays ordered by sample_start.
    `into`: the caller's copy, replaced by it under the same lock (so the last commit leaves the newest)."""
    with manifest_lock(root):
        manifest = read_manifest(root)
        if manifest is None:
            raise StoreError(f"{root}: the manifest is gone while shard {entry['name']} was being written")
        manifest["shards"] = sorted(
            [s for s in manifest["shards"] if s["name"] != entry["name"]] + [entry],
            key=lambda s: s["sample_start"],
        )
        write_manifest(root, manifest)
        if into is not None:
            into.clear()
            into.update(manifest)
    return manifest


def open_for_writing(root: Path, facts: dict, overwrite: bool = False) -> dict:
    """Create or reopen a store for `facts`; returns the manifest. Cleans uncommitted leftovers.

    Raises StoreError when the store holds features made from different facts (unless overwrite).
    """
    root = Path(root)
    facts = json.loads(json.dumps(facts))  # normalise tuples etc. to what JSON gives back
    try:
        manifest = read_manifest(root) if root.exists() else None
    except StoreError:
        if not overwrite or not root.is_dir():  # a file where the store belongs is not ours to delete
            raise
        shutil.rmtree(root)  # another schema or a damaged manifest, replaced on request
        manifest = None
    if manifest is not None and manifest["facts"] != facts:
        if not overwrite:
            diff = sorted(
                k for k in set(facts) | set(manifest["facts"]) if facts.get(k) != manifest["facts"].get(k)
            )
            shown = ", ".join(
                f"{k}: store={manifest['facts'].get(k)!r} asked={facts.get(k)!r}" for k in diff[:4]
            )
            raise StoreError(f"{root} holds features made from other inputs ({shown})")
        shutil.rmtree(root)
        manifest = None
    root.mkdir(parents=True, exist_ok=True)
    if manifest is None:
        manifest = {
            "format": FORMAT,
            "schema_version": SCHEMA_VERSION,
            "checksum": CHECKSUM,
            "facts": facts,
            "shards": [],
        }
        write_manifest(root, manifest)
    committed = {s["name"] for s in manifest["shards"]}
    for entry in root.iterdir():  # a shard renamed but not yet in the manifest, or a .tmp: not complete
        if entry.is_dir() and entry.name.startswith("shard-") and entry.name not in committed:
            shutil.rmtree(entry)
    return manifest


# ------------------------------------------------------------------------------------------------- writer
WRITERS = (
    "tensorstore",
    "zarr",
)  # extract.writer: the same chunk bytes either way (tests/unit/formats/test_store_writer.py)


def write_with_tensorstore(group_dir: Path, buffers: dict[str, np.ndarray]) -> None:
    """Every array of `buffers` into the zarr v3 array of that name under `group_dir` (created by zarr-python
    with its codecs and attributes): tensorstore encodes the chunks (blosc, crc32c) and writes their files on
    its own threads, all arrays at once, outside the GIL. An all-zero chunk is written too (a missing file is
    damage)."""
    try:
        import tensorstore as ts
    except ImportError:
        raise StoreError(
            "extract.writer=tensorstore needs the tensorstore package (requirements.txt pins it), "
            "or set extract.writer=zarr"
        ) from None
    opened = [
        ts.open(
            {
                "driver": "zarr3",
                "kvstore": {"driver": "file", "path": str(Path(group_dir) / name)},
                "open": True,
                "store_data_equal_to_fill_value": True,
            }
        )
        for name in buffers
    ]
    writes = [future.result().write(buffer) for future, buffer in zip(opened, buffers.values())]
    for w in writes:
        w.result()  # committed to the files (or the first failure raised here)


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

    STATES = ("aux_hidden", "last_hidden")  # what writer processes write (the rest is small: this process)
    PIECES = (
        32  # chunk-aligned ranges per array handed to the writer processes: none idles while one finishes
    )

    def __init__(
        self,
        root: Path,
        spec: ShardSpec,
        facts: dict,
        widths: tuple[int, int],
        chunk_tokens: int,
        compressor: str = "blosc_lz4",
        clevel: int = 3,
        shared: bool = False,
        writer: str = "tensorstore",
    ):
        if writer not in WRITERS:
            raise ValueError(f"unknown store writer {writer!r}; expected one of {', '.join(WRITERS)}")
        self.root, self.spec, self.facts, self.writer = Path(root), spec, facts, writer
        self.final = self.root / shard_name(spec.index)
        self.tmp = self.root / (shard_name(spec.index) + ".tmp")
        self.offsets = np.zeros(len(spec.lengths) + 1, dtype=np.int64)
        np.cumsum(spec.lengths, out=self.offsets[1:])
        total = int(self.offsets[-1])
        self.chunk, self.compressors = max(1, min(chunk_tokens, total)), make_compressors(compressor, clevel)
        self.fp8 = store_dtype(facts) == FP8
        # fp8 bytes have no planes for bit-shuffle to separate; entropy-coded as bytes they shrink to 0.85,
        # with lz4 + bit-shuffle to 0.99 (SmolLM2 states, docs/feature_store.md): zstd without shuffle, unless
        # `none`
        self.fp8_compressors = (
            self.compressors
            if compressor == "none"
            else [BloscCodec(cname="zstd", clevel=clevel, shuffle=BloscShuffle.noshuffle), Crc32cCodec()]
        )
        states = np.uint8 if self.fp8 else np.uint16
        self.buffers = {"input_ids": np.zeros(total, np.int32), "loss_mask": np.zeros(total, np.uint8)}
        specs = {"aux_hidden": ((total, widths[0]), states), "last_hidden": ((total, widths[1]), states)}
        # shared: the states in shared memory, for commit(pool=) to write from several processes
        self.shared = shard_regions.SharedArrays(specs) if shared else None
        self.buffers.update(self.shared.arrays if shared else {k: np.zeros(*v) for k, v in specs.items()})
        if self.fp8:
            n_aux = widths[0] // widths[1]
            self.buffers.update(
                aux_scale=np.zeros((total, n_aux), np.float32), last_scale=np.zeros((total, 1), np.float32)
            )
        self.written = np.zeros(len(spec.lengths), dtype=bool)

    def write(
        self,
        local_index: int,
        input_ids: np.ndarray,
        loss_mask: np.ndarray,
        aux_hidden: torch.Tensor,
        last_hidden: torch.Tensor,
        scales=None,
    ) -> None:
        """bf16 store: bf16 states. fp8 store: the uint8 bits and `scales` = (aux [n, n_aux], last [n, 1]) of
        encode_fp8 (extract encodes on the device, so half the bytes cross to the host)."""
        a, b = int(self.offsets[local_index]), int(self.offsets[local_index + 1])
        n = b - a
        if not (len(input_ids) == len(loss_mask) == aux_hidden.shape[0] == last_hidden.shape[0] == n):
            raise ValueError(
                f"sample {self.spec.sample_start + local_index}: lengths disagree with the plan ({n})"
            )
        if self.fp8 != (scales is not None) or (self.fp8 and aux_hidden.dtype != torch.uint8):
            raise TypeError(
                f"a {store_dtype(self.facts)} shard takes "
                f"{'fp8 bits and scales' if self.fp8 else 'bf16 states'}"
            )
        self.buffers["input_ids"][a:b] = input_ids
        self.buffers["loss_mask"][a:b] = loss_mask
        if self.fp8:
            self.buffers["aux_hidden"][a:b] = aux_hidden.cpu().numpy()
            self.buffers["last_hidden"][a:b] = last_hidden.cpu().numpy()
            self.buffers["aux_scale"][a:b] = scales[0].cpu().numpy()
            self.buffers["last_scale"][a:b] = scales[1].cpu().numpy()
        else:
            self.buffers["aux_hidden"][a:b] = bf16_to_bits(aux_hidden)
            self.buffers["last_hidden"][a:b] = bf16_to_bits(last_hidden)
        self.written[local_index] = True

    @staticmethod
    def shared_bytes(tokens: int, widths: tuple[int, int], fp8: bool) -> int:
        """Shared memory one shard of `tokens` tokens holds with shared=True."""
        return tokens * (widths[0] + widths[1]) * (1 if fp8 else 2)

    def commit(self, manifest: dict, pool=None) -> None:
        """Write the shard, rename it into place, enter it in the manifest. `pool` (an Executor of processes,
        with
        shared=True): its processes encode and write chunk-aligned ranges of the states at once."""
        try:
            self._commit(manifest, pool)
        finally:
            self.discard()

    def discard(self) -> None:
        """Drop the host buffers (shared memory unlinked); commit() does it, and so must whoever drops an
        uncommitted writer."""
        self.buffers.clear()
        if self.shared is not None:
            self.shared.release()

    def _commit(self, manifest: dict, pool) -> None:
        missing = np.flatnonzero(~self.written)
        if len(missing):
            raise RuntimeError(f"shard {self.spec.index}: {len(missing)} samples never written")
        if pool is not None and self.shared is None:
            raise ValueError("ShardWriter.commit(pool=...) needs shared=True")
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        group = zarr.open_group(str(self.tmp), mode="w", zarr_format=3)
        group.attrs.update(
            {
                **self.facts,
                "sample_range": [self.spec.sample_start, self.spec.sample_end],
                "num_tokens": int(self.offsets[-1]),
                "shard_index": self.spec.index,
            }
        )
        arrays = {}
        # shapes only: no local view of a (shared) buffer may outlive commit's release, not even in a
        # traceback
        for name, (shape, dtype) in {n: (b.shape, b.dtype) for n, b in self.buffers.items()}.items():
            chunk = self.chunk if len(shape) == 2 else min(shape[0], max(self.chunk, ID_CHUNK_TOKENS))
            arrays[name] = group.create_array(
                name,
                shape=shape,
                chunks=(chunk, *shape[1:]),
                dtype=dtype,
                compressors=self.fp8_compressors
                if self.fp8 and dtype == np.uint8 and len(shape) == 2
                else self.compressors,
                fill_value=0,
                config=ALL_CHUNKS,
            )
            if name in self.STATES:
                arrays[name].attrs.update(
                    {"logical_dtype": LOGICAL_DTYPE, "storage_dtype": str(dtype)}
                    if not self.fp8
                    else {
                        "logical_dtype": LOGICAL_DTYPE,
                        "storage_dtype": "uint8",
                        "encoding": f"{FP8}: value = float8_e4m3fn(bits) x {name[:-7]}_scale",
                    }
                )
        jobs = (
            []
            if pool is None
            else [  # the writer processes start on the states, this process writes the rest
                pool.submit(shard_regions.write_region, str(self.tmp / name), self.shared.handle(name), a, b)
                for name in self.STATES
                for a, b in shard_regions.regions(len(self.buffers[name]), self.chunk, self.PIECES)
            ]
        )
        try:
            mine = [name for name in arrays if not (jobs and name in self.STATES)]
            if self.writer == "tensorstore":
                write_with_tensorstore(self.tmp, {name: self.buffers[name] for name in mine})
            else:
                for name in mine:
                    arrays[name][...] = self.buffers[name]
        finally:
            wait(jobs)  # every range done (or failed) before the buffers can be released
        for job in jobs:
            job.result()
        group.create_array("offsets", data=self.offsets, compressors=[Crc32cCodec()], config=ALL_CHUNKS)
        os.replace(self.tmp, self.final)
        # the caller's copy becomes what is on disk, other processes' and threads' shards included
        add_shard(
            self.root,
            {
                "name": self.final.name,
                "sample_start": self.spec.sample_start,
                "sample_end": self.spec.sample_end,
                "num_tokens": int(self.offsets[-1]),
            },
            into=manifest,
        )
