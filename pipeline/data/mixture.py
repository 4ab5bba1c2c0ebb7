"""data=mix: several sources in one prepared set (conf/data/mix.yaml, `data.sources`).

In this order:
1. each source is read and normalised (pipeline/data/sources.py); its skipped records are counted under its
label;
2. duplicates are dropped across the whole mixture, in source order (the first occurrence stays), on the
   normalised first user turn (sources.norm_text); counted per source;
3. each source sets aside its `heldout` conversations: those whose key (the normalised first user turn) has
the
   smallest blake2b hash, so the choice depends on the text alone, not on order, seed or any limit. They come
   first in the prepared set and are marked held out (docs/prepared.md); train validates on exactly them;
4. the rest of each source is shuffled (data.seed) and cut at the source's `limit`;
5. with `data.limit`: each source's share is `weight / sum of weights` of it (a source with fewer gives what
it
   has; the shortfall is reported, not filled from others); without weights the training conversations are
   shuffled together and cut at data.limit.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
from types import SimpleNamespace

from pipeline.data.sources import Problems, _enum, first_user_turn, norm_text, read_source
from pipeline.errors import UserError

log = logging.getLogger(__name__)

DUPLICATE = "duplicate first user turn"


def check(data) -> list[str]:
    """Every problem of data.sources, as lines."""
    problems, labels = [], [label(s) for s in data.sources]
    if not data.sources:
        problems.append("data=mix needs data.sources: a list of {format, path, limit, weight, heldout}")
    for s, name in zip(data.sources, labels):
        if _enum(s.format) == "mix":
            problems.append(f"data.sources[{name}]: format=mix cannot be nested")
        if s.limit is not None and s.limit < 1:
            problems.append(f"data.sources[{name}].limit={s.limit}: must be >= 1 or null")
        if s.heldout < 0:
            problems.append(f"data.sources[{name}].heldout={s.heldout}: must be >= 0")
        if s.weight is not None and s.weight <= 0:
            problems.append(f"data.sources[{name}].weight={s.weight}: must be > 0 or null")
    if dup := sorted({n for n in labels if labels.count(n) > 1}):
        problems.append(
            f"data.sources: {', '.join(dup)} named twice; give each source of one format its own name"
        )
    weighted = [s.weight is not None for s in data.sources]
    if any(weighted) and not all(weighted):
        problems.append("data.sources: set weight on every source or on none")
    if any(weighted) and data.limit is None:
        problems.append("data.sources have weights, which share data.limit: set data.limit")
    if not re.fullmatch(r"train", data.split.strip()):
        problems.append(f"data.split={data.split!r}: data=mix takes each source whole (split=train)")
    return problems


def label(source) -> str:
    return source.name or _enum(source.format)


def key(conv: dict) -> str:
    return norm_text(first_user_turn(conv))


def rank(k: str, conv: dict) -> bytes:
    """The held-out order: a hash of the dedup key k (of the source id where there is no user turn)."""
    return hashlib.blake2b((k or conv["source_id"]).encode("utf-8"), digest_size=8).digest()


def load(data) -> tuple[list[dict], Problems]:
    """(held-out conversations, then training ones; each marked with `source` and `heldout`) and the
    counts."""
    if problems := check(data):
        raise UserError("; ".join(problems))
    on_error = _enum(data.on_error)
    total = Problems(on_error, "mix")
    seen: set[str] = set()
    heldout, train, report = [], {}, {}
    for s in data.sources:
        name = label(s)
        own = Problems(on_error, name)
        convs = read_source(
            SimpleNamespace(name=name, format=s.format, path=s.path, split="train", extra_sources=[]), own
        )
        read = len(convs)
        kept = []
        for c in convs:
            k = key(c)
            if k and k in seen:
                own.note(DUPLICATE, c["source_id"])
                continue
            seen.add(k)
            c["source"], c["heldout"] = name, False
            if not c["source_id"].startswith(f"{name}:"):
                c["source_id"] = f"{name}:{c['source_id']}"
            kept.append((rank(k, c), c))
        kept = [c for _, c in sorted(kept, key=lambda t: t[0])]
        held, rest = kept[: s.heldout], kept[s.heldout :]
        for c in held:
            c["heldout"] = True
        random.Random(data.seed).shuffle(rest)
        rest = rest[: s.limit] if s.limit is not None else rest
        heldout += held
        train[name] = rest
        report[name] = {
            "format": _enum(s.format),
            "path": s.path,
            "usable": read,
            "duplicates": own.counts[DUPLICATE],
            "heldout": len(held),
            "available": len(rest),
            "limit": s.limit,
            "weight": s.weight,
        }
        if len(held) < s.heldout:
            log.warning(
                "mix: %s has %d conversations after dedup, fewer than heldout=%d", name, len(kept), s.heldout
            )
        for reason, n in own.counts.items():
            total.counts[f"{name}: {reason}"] = n
            total.where[f"{name}: {reason}"] = own.where[reason]
        for reason, n in own.changed.items():
            total.changed[f"{name}: {reason}"] = n
    chosen = _take(data, train, report)
    total.log_summary()
    total.summary = {"sources": report, "heldout": len(heldout), "train": len(chosen)}
    for name, r in report.items():
        log.info(
            "mix: %s: %d usable, %d duplicates dropped, %d held out, %d train",
            name,
            r["usable"],
            r["duplicates"],
            r["heldout"],
            r["train"],
        )
    # the sources' held-out conversations interleaved by their hash, not source after source: evaluate's
    # `heldout` prompts and training's tau probe each take the first of their half, and both must see every
    # source
    heldout.sort(key=lambda c: rank(key(c), c))
    return heldout + chosen, total


def _take(data, train: dict[str, list], report: dict) -> list[dict]:
    """The training conversations: by weight (shares of data.limit), or shuffled together and cut at
    data.limit."""
    weights = {name: r["weight"] for name, r in report.items()}
    if data.limit is not None and all(w is not None for w in weights.values()):
        total = sum(weights.values())
        chosen = []
        for name, convs in train.items():
            want = round(data.limit * weights[name] / total)
            report[name]["asked"] = want
            if len(convs) < want:
                log.warning(
                    "mix: %s has %d training conversations, fewer than its share %d of data.limit=%d",
                    name,
                    len(convs),
                    want,
                    data.limit,
                )
            chosen += convs[:want]
    else:
        chosen = [c for convs in train.values() for c in convs]
    if data.shuffle:
        random.Random(data.seed).shuffle(chosen)
    if data.limit is not None:
        chosen = chosen[: data.limit]
    for name in report:
        report[name]["train"] = sum(c["source"] == name for c in chosen)
    return chosen


def load_conversations(data) -> tuple[list[dict], Problems]:
    """All valid conversations of the configured source, after split, shuffle and limit (data=mix:
    pipeline/data/mixture.py)."""
    fmt = _enum(data.format)
    if fmt == "mix":
        return load(data)
    extras = list(getattr(data, "extra_sources", None) or [])
    problems = Problems(_enum(data.on_error), " + ".join([data.path or fmt, *extras]))
    convs = read_source(data, problems)
    if data.shuffle:
        random.Random(data.seed).shuffle(convs)
    if data.limit is not None:
        convs = convs[: data.limit]
    problems.log_summary()
    return convs, problems
