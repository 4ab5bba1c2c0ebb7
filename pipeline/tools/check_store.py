"""`eaglepipe check-store run_dir=...`: read every chunk of a feature store and check its crc32c.

Reports each damaged, truncated or missing chunk, and each shard whose metadata (zarr.json) cannot be read,
by shard, and exits 2 when there is one; writes nothing. `eaglepipe stage=extract extract.repair=true
run_dir=...` (with the run's own overrides) extracts exactly the damaged shards again. A manifest.json that
cannot be read is listed too, with every shard folder on disk checked against its own metadata: the repair
rebuilds the manifest from those that verify.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path

from pipeline.errors import UserError
from pipeline.formats import feature_store as fs
from pipeline.formats import store_check
from pipeline.formats.run_dir import RunDir

log = logging.getLogger(__name__)


def _repair(cfg) -> str:
    return f"`eaglepipe stage=extract extract.repair=true run_dir={cfg.run_dir}` plus the run's own overrides"


def _print(bad: list[dict]) -> dict[str, list[dict]]:
    by_shard = defaultdict(list)
    for b in bad:
        by_shard[b["shard"]].append(b)
    for shard, problems in sorted(by_shard.items()):
        for b in problems:
            chunk = "" if b["chunk"] is None else f" chunk {b['chunk']}"
            print(f"{shard}/{b['array']}{chunk}: {b['problem']}")
    return by_shard


def _without_manifest(cfg, root: Path, damaged: fs.ManifestDamaged) -> None:
    """The manifest cannot be read: it and every shard folder on disk, checked against its own metadata."""
    print(f"{fs.MANIFEST}: cannot be read")
    shards = store_check.survey(root)
    for name in sorted(n for n, bad in shards.items() if not bad):
        print(f"{name}: verifies against its own metadata")
    _print([b for bad in shards.values() for b in bad])
    good = sum(not bad for bad in shards.values())
    raise UserError(
        f"check-store: {damaged.path} is damaged ({damaged.what}); {good} of {len(shards)} shard(s) on disk "
        f"verify against their own metadata: rebuild the manifest from them with {_repair(cfg)} (it "
        "extracts the others again)"
    )


def run(cfg) -> Path:
    root = RunDir.of(cfg).features
    try:
        manifest = fs.read_manifest(root)
        if manifest is None:
            raise fs.StoreError(f"no feature store at {root} (no {fs.MANIFEST}); run stage=extract")
        bad = store_check.verify_store(root)
    except fs.ManifestDamaged as e:
        _without_manifest(cfg, root, e)
    except fs.StoreError as e:
        raise UserError(f"check-store: {e}") from None
    by_shard = _print(bad)
    shards = len(manifest["shards"])
    if bad:
        names = ", ".join(sorted(by_shard))
        raise UserError(
            f"check-store: {len(bad)} damaged chunk(s) in {len(by_shard)} of {shards} shard(s) of "
            f"{root} ({names}); extract them again with {_repair(cfg)}"
        )
    print(f"check-store: {root}: {shards} shard(s), every chunk passes its {fs.CHECKSUM} check")
    return root
