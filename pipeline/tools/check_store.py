"""`eaglepipe check-store run_dir=...`: read every chunk of a feature store and check its crc32c.

Reports each damaged, truncated or missing chunk by shard and exits 2 when there is one; writes nothing.
`eaglepipe stage=extract extract.repair=true run_dir=...` (with the run's own overrides) extracts exactly the
damaged shards again.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path

from pipeline.errors import UserError
from pipeline.formats import feature_store as fs
from pipeline.formats.run_dir import RunDir

log = logging.getLogger(__name__)


def run(cfg) -> Path:
    root = RunDir.of(cfg).features
    try:
        bad = fs.verify_store(root)
        manifest = fs.read_manifest(root)
    except fs.StoreError as e:
        raise UserError(f"check-store: {e}") from None
    by_shard = defaultdict(list)
    for b in bad:
        by_shard[b["shard"]].append(b)
    for shard, problems in sorted(by_shard.items()):
        for b in problems:
            chunk = "" if b["chunk"] is None else f" chunk {b['chunk']}"
            print(f"{shard}/{b['array']}{chunk}: {b['problem']}")
    shards = len(manifest["shards"])
    if bad:
        names = ", ".join(sorted(by_shard))
        raise UserError(
            f"check-store: {len(bad)} damaged chunk(s) in {len(by_shard)} of {shards} shard(s) of "
            f"{root} ({names}); extract them again with `eaglepipe stage=extract extract.repair=true "
            f"run_dir={cfg.run_dir}` plus the run's own overrides"
        )
    print(f"check-store: {root}: {shards} shard(s), every chunk passes its {fs.CHECKSUM} check")
    return root
