"""Stage `prepare`: conversations -> chat-templated token ids with an assistant-only loss mask.

Output run_dir/prepared/: a `datasets` folder (input_ids, loss_mask, sample_id, source_id) and
stats.json (counts, what produced it, and the `prepared_fingerprint` later stages check against).
Mask rule (docs/prepared.md): a token is supervised iff its first character lies inside an assistant
turn's rendered content or the end-of-turn token right after it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from pipeline import __version__
from pipeline.corpora import EMBEDDED
from pipeline.data import leaks, mixture
from pipeline.data.chat_tokens import cut_long_prompts, cut_turns, tokenize_all
from pipeline.data.mixture import load_conversations
from pipeline.data.regenerate import all_kept, journal_folder, regenerate
from pipeline.data.synthesize import synthesize
from pipeline.errors import UserError
from pipeline.fingerprint import digest, shaping
from pipeline.formats import file_digest, prepared
from pipeline.formats.run_dir import RunDir
from pipeline.models import targets
from pipeline.serving import regenerate_server

log = logging.getLogger(__name__)
# how the replies are fetched, not what they are (the journal keys them by what shapes them)
NOT_SHAPING = (
    "regenerate_endpoint",
    "regenerate_server",
    "endpoint_concurrency",
    "endpoint_timeout_s",
    "endpoint_retries",
    "endpoint_backoff_s",
)


def out_dir(cfg) -> Path:
    return prepared.folder(cfg.run_dir)


def check(cfg) -> None:
    problems = []  # ranges: config_limits, checked before every stage's check
    if unknown := [x for x in cfg.data.extra_sources if x not in EMBEDDED]:
        problems.append(f"data.extra_sources: {unknown} not among the embedded sources {sorted(EMBEDDED)}")
    if cfg.prepare.regenerate_endpoint and not cfg.prepare.regenerate:
        problems.append(
            "prepare.regenerate_endpoint is set but prepare.regenerate=false; set regenerate=true"
        )
    problems += _check_generation(cfg.prepare)
    if str(getattr(cfg.data.format, "value", cfg.data.format)) == "mix":
        problems += mixture.check(cfg.data)
    elif cfg.data.sources:
        problems.append(f"data.sources is for data=mix, not data={cfg.data.name}")
    if problems:
        raise UserError("; ".join(problems))


def fingerprint(cfg) -> str:
    folder = targets.resolve(cfg.target, cfg.cache_dir)
    data = OmegaConf.to_container(cfg.data, resolve=True, enum_to_str=True)
    for entry in [data, *data.get("sources", [])]:
        if entry.get("path") and Path(entry["path"]).exists():
            entry["_file"] = _content(Path(entry["path"]))
    return digest(
        {
            "target": targets.fingerprint(folder),
            "data": data,
            "version": prepared.SCHEMA_VERSION,
            "prepare": shaping(cfg.prepare, NOT_SHAPING),
        }
    )


def _content(path: Path) -> str:
    """What a data file (or every file of a data folder) holds, by content: a file replaced by another of
    the same size and mtime is not up to date (sha256 of every byte, ~1 GB/s; formats/file_digest)."""
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    sums = {f.relative_to(path).as_posix() if f != path else "": file_digest.sha256(f) for f in files}
    size, d = sum(f.stat().st_size for f in files), digest(sums)
    log.info(
        "prepare: %s read by content for its fingerprint: %d file(s), %s bytes, digest %s",
        path,
        len(files),
        f"{size:,}",
        d,
    )
    return d


def _check_generation(p) -> list[str]:
    problems = []
    server = str(getattr(p.regenerate_server.engine, "value", p.regenerate_server.engine))
    if server != "none" and p.regenerate_endpoint:
        problems.append(
            f"prepare.regenerate_server.engine={server} and prepare.regenerate_endpoint are both set; "
            "keep one (the server eaglepipe starts becomes the endpoint)"
        )
    if server != "none" and not p.regenerate:
        problems.append(
            f"prepare.regenerate_server.engine={server} but prepare.regenerate=false; set regenerate=true"
        )
    if p.synthesize and not p.regenerate:
        problems.append(
            "prepare.synthesize needs prepare.regenerate=true (the target answers its own prompts)"
        )
    if p.synthesize_min_chars > p.synthesize_max_chars:
        problems.append(
            f"prepare.synthesize_min_chars={p.synthesize_min_chars} > prepare.synthesize_max_chars="
            f"{p.synthesize_max_chars}: every synthesized prompt would be filtered out"
        )
    return problems


def is_complete(cfg) -> bool:
    return RunDir.of(cfg).prepared_stats.is_file()


def run(cfg) -> Path:
    check(cfg)
    folder = targets.resolve(cfg.target, cfg.cache_dir)
    targets.load_config(folder, cfg.target)
    tok = targets.load_tokenizer(folder, cfg.target)
    convs, problems = load_conversations(cfg.data)
    if not convs:
        raise UserError(f"data={cfg.data.name}: no usable conversation (skipped: {problems.as_dict()})")
    log.info(
        "prepare: %d conversations from %s (skipped %d)",
        len(convs),
        problems.origin,
        sum(problems.counts.values()),
    )
    cut = cut_turns(convs, cfg.prepare.max_assistant_turns)
    if cut:
        log.info(
            "prepare: %d conversations cut after their first %d assistant turns "
            "(prepare.max_assistant_turns)",
            cut,
            cfg.prepare.max_assistant_turns,
        )
    convs, leak_report = leaks.check(convs, str(getattr(cfg.data.on_leak, "value", cfg.data.on_leak)))
    if not convs:
        raise UserError(
            f"data={cfg.data.name}: every conversation holds an MT-bench or HumanEval prompt (dropped)"
        )
    server = cfg.prepare.regenerate_server
    if cfg.prepare.regenerate and not cfg.prepare.synthesize:
        convs[:], long_prompts = cut_long_prompts(tok, convs, cfg.prepare.max_len)
        if str(getattr(server.engine, "value", server.engine)) != "none" and all_kept(
            cfg, folder, tok, convs
        ):
            log.info("prepare: kept answers serve every turn (docs/answers.md): no regenerate server started")
            server = OmegaConf.merge(server, {"engine": "none"})
    with regenerate_server.serving(
        server,
        folder,
        journal_folder(cfg) / "server.log",
        cfg.prepare.regenerate_model or cfg.target.name,
        cfg.prepare.endpoint_concurrency,
    ) as endpoint:
        synth_stats = None
        if cfg.prepare.synthesize:
            n = len(convs)
            synth_stats = synthesize(cfg, folder, tok, convs, endpoint)
            # a prompt the target wrote is checked as the data's were (it can recite a HumanEval prompt)
            convs[n:], synth_stats["leaks"] = leaks.check(
                convs[n:], str(getattr(cfg.data.on_leak, "value", cfg.data.on_leak))
            )
        if cfg.prepare.regenerate and cfg.prepare.synthesize:  # (else cut above)
            convs[:], long_prompts = cut_long_prompts(tok, convs, cfg.prepare.max_len)
        if cfg.prepare.regenerate:
            regen_stats = regenerate(cfg, folder, tok, convs, endpoint) | {"long_prompts": long_prompts}
        else:
            regen_stats = None

    rows, drops, heldout, truncated = tokenize_all(tok, convs, cfg.prepare.max_len)
    drops.log_summary()
    if not rows["sample_id"]:
        raise UserError(f"prepare: every conversation was dropped ({drops.as_dict()})")
    stats = _stats(cfg, folder, tok, rows, problems, drops, truncated, regen_stats) | {
        "synthesize": synth_stats
    }
    stats |= {"leaks": leak_report, "heldout_samples": heldout, "mix": problems.summary}
    prepared.save(out_dir(cfg), rows, stats)
    log.info(
        "prepare: %d samples, %d tokens (%d supervised, %.1f%%), %d truncated -> %s",
        stats["samples"],
        stats["tokens"],
        stats["supervised_tokens"],
        100 * stats["supervised_tokens"] / stats["tokens"],
        truncated,
        out_dir(cfg),
    )
    return out_dir(cfg)


def _stats(cfg, folder, tok, rows, problems, drops, truncated, regen_stats) -> dict:
    lengths = np.array([len(x) for x in rows["input_ids"]])
    supervised = int(sum(sum(m) for m in rows["loss_mask"]))
    return {
        "schema_version": prepared.SCHEMA_VERSION,
        "produced_by": f"eaglepipe {__version__}",
        "prepared_fingerprint": fingerprint(cfg),
        "target_path": str(folder),
        "target_fingerprint": targets.fingerprint(folder),
        "chat_template_hash": targets.chat_template_hash(tok),
        "max_len": cfg.prepare.max_len,
        "data": cfg.data.name,
        "samples": len(lengths),
        "tokens": int(lengths.sum()),
        "supervised_tokens": supervised,
        "truncated": truncated,
        "length_mean": float(lengths.mean()),
        "length_max": int(lengths.max()),
        "skipped_records": problems.as_dict(),
        "changed_records": dict(problems.changed),
        "dropped_samples": drops.as_dict(),
        "regenerate": regen_stats,
    }
