"""The prepared set (`run_dir/prepared/`, docs/prepared.md): an HF `datasets` folder + stats.json.

Written by stage `prepare`, read by `extract` (and tests, benchmarks). Writing goes to `prepared.tmp` and is
renamed into place, so a folder with stats.json is always complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from pipeline.errors import UserError
from pipeline.formats import faults

SCHEMA_VERSION = 1


STATS = (
    "stats.json"  # counts, what produced it, the prepared fingerprint; written last: the folder is complete
)


def folder(run_dir: Path | str) -> Path:
    return Path(run_dir) / "prepared"


def save(out: Path, rows: dict, stats: dict) -> None:
    import datasets

    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("uint8")),
            "sample_id": datasets.Value("int64"),
            "source_id": datasets.Value("string"),
        }
    )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp))
    (tmp / STATS).write_text(json.dumps(stats, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def heldout_samples(run_dir: Path | str) -> list[int] | None:
    """The sample ids data=mix set aside (stats.json `heldout_samples`): train validates on exactly these,
    never trains on them. None: no prepared folder here (a feature store copied alone); [] (or the key absent,
    a set
    prepared before data=mix existed): none set aside, train holds out train.val_fraction by sample."""
    path = folder(run_dir) / STATS
    if not path.is_file():
        return None
    ids = faults.read_json(path, _fix(path.parent)).get("heldout_samples") or []
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        raise UserError(f"{path}: heldout_samples must be sample ids (ints >= 0); rerun stage=prepare")
    return ids


def _fix(out: Path) -> str:
    return f"delete {out} and rerun stage=prepare"


def load(run_dir: Path | str, limit: int | None = None):
    """(dataset, stats) of a prepared folder, or a UserError telling which stage to run."""
    import datasets

    out = folder(run_dir)
    if not (out / STATS).is_file():
        raise UserError(f"no prepared data under {out}; run stage=prepare first")
    stats = faults.read_json(out / STATS, _fix(out))
    if stats.get("schema_version") != SCHEMA_VERSION:
        raise UserError(
            f"{out} has schema {stats.get('schema_version')}, expected {SCHEMA_VERSION}; rerun stage=prepare"
        )
    with faults.reading(f"{out} (its arrow files)", _fix(out)):
        ds = datasets.load_from_disk(str(out))
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return ds, stats
