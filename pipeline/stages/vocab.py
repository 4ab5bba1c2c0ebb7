"""Stage `vocab`: the draft vocabulary from supervised-token counts of the feature store.

Counts input_ids where loss_mask == 1 (what the draft must predict; as speculators and SpecForge do), keeps
the top `vocab.draft_vocab_size`, and writes run_dir/vocab/ (pipeline/formats/vocab_map.py) with a
report: share of supervised tokens covered, distinct ids seen, ids padded in, the top tokens.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from pipeline import __version__
from pipeline.capture import features
from pipeline.errors import UserError
from pipeline.fingerprint import digest
from pipeline.formats import vocab_map
from pipeline.formats.run_dir import RunDir
from pipeline.models import targets

log = logging.getLogger(__name__)
HOLD_EVERY = 10  # the held-out coverage's split: every 10th unit of the store's tokens (sample or shard)


def out_dir(cfg) -> Path:
    return RunDir.of(cfg).vocab


def check(cfg) -> None:
    """vocab.draft_vocab_size against the target's declared vocabulary, before prepare and extract run (the
    store's recorded vocab_size is checked again in run)."""
    K = cfg.vocab.draft_vocab_size
    V = None if OmegaConf.is_missing(cfg.target, "vocab_size") else cfg.target.vocab_size
    if K < 1 or (V is not None and K > V):
        raise UserError(
            f"vocab.draft_vocab_size={K}: must be in [1, {V or 'the target vocabulary'}] "
            f"(target {cfg.target.name}'s vocabulary)"
        )


def fingerprint(cfg) -> str:
    return digest(
        {"features": features.fingerprint_text(cfg), "draft_vocab_size": cfg.vocab.draft_vocab_size}
    )


def is_complete(cfg) -> bool:
    """The manifest (written last) and the tables it vouches for, readable and valid: a vocab damaged after
    it was built (vocab.safetensors removed or truncated) is built again, never skipped as up to date."""
    from safetensors import SafetensorError

    try:
        vocab_map.load(out_dir(cfg))
    except (vocab_map.VocabError, UserError, OSError, ValueError, KeyError, SafetensorError) as e:
        log.warning("stage vocab: %s cannot be read (%s): building it again", out_dir(cfg), e)
        return False
    return True


def _count(store, V: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Supervised-token counts over the store, and apart the counts of every HOLD_EVERY-th unit (sample;
    offline store: shard), the held-out part of the coverage."""
    freq, held = np.zeros(V, dtype=np.int64), np.zeros(V, dtype=np.int64)
    units = 0
    for units, (ids, mask) in enumerate(store.iter_tokens(), start=1):
        np.add.at(freq, ids[mask.astype(bool)], 1)
        if units % HOLD_EVERY == 0:
            np.add.at(held, ids[mask.astype(bool)], 1)
    return freq, held, units


def run(cfg) -> Path:
    check(cfg)
    store = features.open_source(cfg)  # online: prepared/'s tokens, the target never loaded
    V, K = int(store.facts["vocab_size"]), cfg.vocab.draft_vocab_size
    if not 1 <= K <= V:
        raise UserError(f"vocab.draft_vocab_size={K}: must be in [1, {V}] (the target vocabulary)")
    freq, held, units = _count(store, V)
    d2t, t2d, padded = vocab_map.build(freq, K)
    if padded:
        log.warning(
            "vocab: only %d distinct supervised ids seen; %d lowest unused ids padded in to reach %d",
            K - padded,
            padded,
            K,
        )
    used = np.arange(K) + d2t.numpy()
    coverage = float(freq[used].sum() / max(freq.sum(), 1))
    sizes = sorted(k for k in {*vocab_map.COMPARED_SIZES, K, V} if k <= V)
    by_size = vocab_map.coverage_by_size(freq, sizes)
    held_by_size = (  # chosen on the other units, measured on these: the in-sample figure overstates
        vocab_map.heldout_coverage_by_size(freq - held, held, sizes) if units >= HOLD_EVERY else None
    )
    need = {share: vocab_map.smallest_covering(freq, share) for share in (0.99, 0.999)}
    tok = targets.load_tokenizer(Path(store.facts["target_path"]), cfg.target)
    top = np.argsort(-freq, kind="stable")[:20]
    report = {
        "supervised_tokens": int(freq.sum()),
        "distinct_ids_seen": int((freq > 0).sum()),
        "padded_ids": padded,
        "coverage": coverage,
        # what another vocab.draft_vocab_size would cover (issue #37: chosen by measurement at 150K+)
        "coverage_by_size": {str(k): c for k, c in by_size.items()},
        "heldout_coverage_by_size": held_by_size and {str(k): c for k, c in held_by_size.items()},
        "heldout_units": units // HOLD_EVERY,
        "ids_for_coverage": {str(share): n for share, n in need.items()},
        "top_tokens": [
            {"id": int(i), "token": tok.convert_ids_to_tokens(int(i)), "count": int(freq[i])}
            for i in top
            if freq[i] > 0
        ],
    }
    info = {
        "produced_by": f"eaglepipe {__version__}",
        "features_manifest_hash": store.manifest_hash(),
        "target_fingerprint": store.facts["target_fingerprint"],
        "coverage": coverage,
        "padded_ids": padded,
    }
    vocab_map.save(out_dir(cfg), d2t, t2d, freq, info)
    (out_dir(cfg) / vocab_map.REPORT).write_text(json.dumps(report, indent=1))
    log.info(
        "vocab: %d draft ids cover %.2f%% of the %d supervised tokens they were chosen on (in-sample; %d "
        "distinct seen, %d padded)",
        K,
        100 * coverage,
        freq.sum(),
        report["distinct_ids_seen"],
        padded,
    )
    log.info(
        "vocab: coverage by draft vocabulary size, in-sample: %s; 99%% of the supervised tokens need %d ids, "
        "99.9%% %d",
        ", ".join(f"{k:,} {100 * c:.2f}%" for k, c in by_size.items()),
        need[0.99],
        need[0.999],
    )
    if held_by_size is None:
        log.info("vocab: no held-out coverage: %d unit(s) of tokens, fewer than %d", units, HOLD_EVERY)
    else:
        log.info(
            "vocab: coverage of every %dth unit's tokens (%d units) by the ids the others count most: %s",
            HOLD_EVERY,
            units // HOLD_EVERY,
            ", ".join(f"{k:,} {100 * c:.2f}%" for k, c in held_by_size.items()),
        )
    return out_dir(cfg)
