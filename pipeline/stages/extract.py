"""Stage `extract`: the target's aux + last hidden states of every prepared sample, into the feature store.

The stage checks the config and says what shapes the store (its fingerprint); the work is
pipeline/capture/store.py: backends `hf` (forward hooks, pipeline/capture/hf.py) and `sglang` (SGLang's own
ModelRunner, tensor parallel under torchrun; pipeline/engines/sglang_capture.py) feed the same shard writer.
The aux-layer numbering is pipeline/capture/aux_layers.py; shards are planned from the prepared lengths alone,
so a killed run resumes at the first shard missing from the manifest.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import OmegaConf

from pipeline.capture import settings, store
from pipeline.capture.settings import backend
from pipeline.fingerprint import digest
from pipeline.formats import feature_store as fs
from pipeline.formats.run_dir import RunDir
from pipeline.models import targets

log = logging.getLogger(__name__)


def out_dir(cfg) -> Path:
    return RunDir.of(cfg).features


def check(cfg) -> None:
    settings.check(cfg)


def fingerprint(cfg) -> str:
    stats_path = RunDir.of(cfg).prepared_stats
    prepared = stats_path.read_text() if stats_path.exists() else None
    # the SGLang knobs shape nothing under backend=hf; SGLang's memory fraction never shapes the states
    leave_out = {
        "overwrite",
        "repair",
        "device",
        "max_batch_size",
        "chunk_tokens",
        "compressor",
        "clevel",
        "sglang_mem_fraction",
        "write_workers",
        "writer",
    }
    if backend(cfg) != "sglang":
        leave_out.add("sglang_attention_backend")
    shaping = {
        k: v
        for k, v in OmegaConf.to_container(cfg.extract, resolve=True, enum_to_str=True).items()
        if k not in leave_out
    }
    return digest(
        {
            "prepared": prepared,
            "target": targets.fingerprint(targets.resolve(cfg.target, cfg.cache_dir)),
            "extract": shaping,
            "store_schema": fs.SCHEMA_VERSION,
        }
    )


def is_complete(cfg) -> bool:
    if cfg.extract.repair:
        return False  # a repair always looks at every chunk
    try:
        manifest = fs.read_manifest(out_dir(cfg))
    except fs.StoreError:
        return False
    return bool(manifest and manifest.get("complete"))


def run(cfg) -> Path:
    check(cfg)
    return store.extract(cfg)
