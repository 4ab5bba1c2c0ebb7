"""The target's answers kept for reuse (`data/answers/*.jsonl.xz`, docs/answers.md): one reader/writer.

An answer at temperature 0 is a pure function of the target, the prompt as rendered and the decoding settings,
so a file of them can be kept in the repository and reused by any run that asks the same questions.

File: xz-compressed JSON lines. Line 1 is the header, every other line one answer:

    {"kind": "eaglepipe-answers", "schema": 1, "key": {...}, "produced_by": {...}, "answers": N,
     "sha256": "<of the answer lines>"}
    {"p": "<16 hex: digest of the prompt's messages>", "a": "<answer text>", "n": <completion tokens>}

`key` holds everything that determines an answer (the target's weights and tokenizer, the chat template, the
temperature, max_new_tokens); `produced_by` what made it (engine, dtype, commit), recorded, not matched.
The header's sha256 covers the answer lines as written, so a damaged or edited file is refused on read.
A greedy answer cut at N tokens is the first N tokens of the same answer with a larger budget: an answer of
fewer than max_new_tokens tokens ended by itself and serves every budget at or above its length.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import UserError

KIND, SCHEMA = "eaglepipe-answers", 1
SPARE_BYTES = 64 * 2**20  # left free on the disk after writing


class NoRoom(OSError):
    """Too little disk for the file (nothing was written)."""


KEY_FIELDS = ("target", "tokenizer", "chat_template", "temperature", "max_new_tokens")


def prompt_key(messages: list[dict]) -> str:
    """The digest of the messages an answer replies to (role and content only, in order): sha256 of their
    sorted-key JSON, its first 16 hex digits (the file's keys were written so: never change this)."""
    obj = [{"role": m["role"], "content": m["content"]} for m in messages]
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class Answers:
    key: dict
    produced_by: dict
    by_prompt: dict[str, dict] = field(default_factory=dict)  # prompt_key -> {"a": text, "n": tokens}
    path: Path | None = None

    def get(self, messages: list[dict]) -> dict | None:
        return self.by_prompt.get(prompt_key(messages))


def write(path: Path, key: dict, produced_by: dict, records: Iterable[tuple[list[dict], str, int]]) -> int:
    """records: (prompt messages, answer text, completion tokens). Written to a temporary name and renamed:
    a file at `path` is always whole. Returns the number of answers written (one per distinct prompt)."""
    missing = [k for k in KEY_FIELDS if k not in key]
    if missing:
        raise ValueError(f"answers key lacks {missing}")
    seen, lines = set(), []
    for messages, text, tokens in records:
        p = prompt_key(messages)
        if p in seen:
            continue
        seen.add(p)
        lines.append(json.dumps({"p": p, "a": text, "n": int(tokens)}, ensure_ascii=False))
    body = ("\n".join(lines) + "\n").encode() if lines else b""
    header = {
        "kind": KIND,
        "schema": SCHEMA,
        "key": key,
        "produced_by": produced_by,
        "answers": len(lines),
        "sha256": hashlib.sha256(body).hexdigest(),
    }
    blob = lzma.compress((json.dumps(header) + "\n").encode() + body, preset=6)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path.parent).free
    if free < len(blob) + SPARE_BYTES:
        raise NoRoom(f"{path}: {len(blob) / 2**20:.1f} MiB to write, {free / 2**20:.1f} MiB free")
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(blob)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return len(lines)


def read(path: Path) -> Answers:
    """The whole file, checked: one UserError line if it is damaged, truncated or not an answers file."""
    path = Path(path)
    try:
        with lzma.open(path, "rb") as f:
            data = f.read()
    except (OSError, lzma.LZMAError, EOFError) as e:
        raise UserError(
            f"{path}: not a readable answers file ({e}); delete it or restore it from git"
        ) from None
    head, _, body = data.partition(b"\n")
    try:
        header = json.loads(head)
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("kind") != KIND:
        raise UserError(f"{path}: not an eaglepipe answers file (its first line is no answers header)")
    if header.get("schema") != SCHEMA:
        raise UserError(f"{path}: answers schema {header.get('schema')}, this eaglepipe reads {SCHEMA}")
    if hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise UserError(
            f"{path}: damaged (its answers do not match the header's sha256); restore it from git"
        )
    out = Answers(header["key"], header.get("produced_by", {}), path=path)
    for line in body.split(b"\n")[:-1] if body else []:
        rec = json.loads(line)
        out.by_prompt[rec["p"]] = {"a": rec["a"], "n": rec["n"]}
    if len(out.by_prompt) != header.get("answers"):
        raise UserError(f"{path}: {len(out.by_prompt)} answers where the header says {header.get('answers')}")
    return out
