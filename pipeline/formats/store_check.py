"""Checking a feature store, and rebuilding its manifest from the shards (`eaglepipe check-store`,
`extract.repair=true`; docs/feature_store.md, "Checksums"). Pure module.

A shard is checked against its own metadata and its chunks' crc32c: its group's zarr.json (the facts it was
made from, its sample range and token count in its attributes), every array's zarr.json and row count, every
chunk file. So a manifest.json that cannot be read loses nothing: the shards on disk that verify, made from
the run's facts, are entered in a new manifest, and extract redoes the others.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.formats import feature_store as fs

SHARD_ATTRS = ("sample_range", "num_tokens", "shard_index")  # what a shard's attributes add to the facts


def _bad(shard: str, array: str, chunk: int | None, problem: str) -> dict:
    return {"shard": shard, "array": array, "chunk": chunk, "problem": problem}


def verify_shard(root: Path, entry: dict, facts: dict) -> list[dict]:
    """Every problem of one shard ({shard, array, chunk, problem}; empty: it verifies), against its manifest
    `entry` ({name, sample_start, sample_end, num_tokens}) and the store's `facts`."""
    name, rows = entry["name"], entry["num_tokens"]
    try:
        group = fs.open_group(root, name)
    except fs.ChunkError as e:
        return [_bad(name, "(group)", None, e.what)]
    span = [entry["sample_start"], entry["sample_end"]]
    if group.attrs.get("sample_range") != span or group.attrs.get("num_tokens") != rows:
        return [_bad(name, "(group)", None, f"its attributes are not samples {span}, {rows} tokens")]
    bad = []
    for array in fs.arrays(facts):
        try:
            arr = group[array]
        except fs.METADATA_ERRORS as e:
            bad.append(_bad(name, array, None, fs.metadata_problem(e)))
            continue
        want = span[1] - span[0] + 1 if array == "offsets" else rows
        if arr.shape[0] != want:
            bad.append(_bad(name, array, None, f"zarr.json says {arr.shape[0]} rows, the shard has {want}"))
            continue
        missing = set(fs.missing_chunks(root / name, group, array))
        for i in range(arr.cdata_shape[0]):
            key = f"{array}/{arr.metadata.encode_chunk_key((i,) + (0,) * (arr.ndim - 1))}"
            if key in missing:
                bad.append(_bad(name, array, i, "chunk file missing"))
            elif fs.chunk_fails(arr, i):
                bad.append(_bad(name, array, i, f"fails its {fs.CHECKSUM} check (damaged or truncated)"))
    if not bad and int(np.asarray(group["offsets"][-1])) != rows:
        bad.append(_bad(name, "offsets", None, f"its last offset is not the shard's {rows} tokens"))
    return bad


def verify_store(root: Path | str) -> list[dict]:
    """Read and check every committed shard; one {shard, array, chunk, problem} per bad chunk or metadata."""
    root = Path(root)
    manifest = fs.read_manifest(root)
    if manifest is None:
        raise fs.StoreError(f"no feature store at {root} (no {fs.MANIFEST})")
    return [b for s in manifest["shards"] for b in verify_shard(root, s, manifest["facts"])]


def own_metadata(root: Path, name: str) -> tuple[dict, dict] | None:
    """(manifest entry, facts) of a shard folder as its own attributes give them; None where they cannot be
    read or are not a shard's."""
    try:
        attrs = dict(fs.open_group(root, name).attrs)
        start, end = attrs["sample_range"]
        entry = {"name": name, "sample_start": start, "sample_end": end, "num_tokens": attrs["num_tokens"]}
        ints = all(isinstance(entry[k], int) for k in fs.SHARD_KEYS - {"name"})
        ok = ints and fs.shard_name(attrs["shard_index"]) == name
    except (fs.ChunkError, KeyError, TypeError, ValueError):
        return None
    return (entry, {k: v for k, v in attrs.items() if k not in SHARD_ATTRS}) if ok else None


def on_disk(root: Path) -> list[str]:
    """The shard folders of a store (committed or not: without a manifest nothing says which)."""
    return sorted(p.name for p in Path(root).glob("shard-*.zarr") if p.is_dir())


def survey(root: Path | str) -> dict[str, list[dict]]:
    """Without a manifest: every shard folder on disk checked against its own metadata -> its problems."""
    out = {}
    for name in on_disk(Path(root)):
        own = own_metadata(Path(root), name)
        out[name] = (
            verify_shard(Path(root), *own)
            if own
            else [_bad(name, "(group)", None, "its attributes cannot be read")]
        )
    return out


def rebuild_manifest(root: Path | str, facts: dict) -> tuple[list[str], list[str]]:
    """A manifest.json that cannot be read, written again (under the manifest lock) from the shard folders
    that verify against their own metadata and were made from `facts` (the run's own, as extract computes
    them); the others are left out, so extract redoes them. Returns (kept, left out). A shard made from other
    facts stops it (StoreError): it may be all that is left of another run, and extract would delete it."""
    root, facts = Path(root), json.loads(json.dumps(facts))
    kept, left_out, other = [], [], []
    for name in on_disk(root):
        own = own_metadata(root, name)
        if own and own[1] != facts:
            other.append(name)
        elif own and not verify_shard(root, own[0], facts):
            kept.append(own[0])
        else:
            left_out.append(name)
    if other:
        raise fs.StoreError(
            f"{root}: {', '.join(other)} were made from other inputs than this run's; a repair cannot tell "
            "whose store this is: use the run's own overrides, or extract.overwrite=true to replace the store"
        )
    manifest = {
        "format": fs.FORMAT,
        "schema_version": fs.SCHEMA_VERSION,
        "checksum": fs.CHECKSUM,
        "facts": facts,
        "shards": sorted(kept, key=lambda s: s["sample_start"]),
        "complete": False,  # extract marks it complete once every planned shard is in it
    }
    with fs.manifest_lock(root):
        fs.write_manifest(root, manifest)
    return [s["name"] for s in manifest["shards"]], left_out
