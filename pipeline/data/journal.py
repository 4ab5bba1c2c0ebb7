"""Regeneration's journal: every generated text committed as it comes, so a rerun continues where a run
stopped.

`run_dir/prepared.partial/regenerate-<fingerprint>.jsonl`, one JSON object per line, append-only:

    {"key": "<16 hex>", "text": "...", "tokens": 17}

The key hashes what the text was generated from (a conversation's source id, the turn's index and the messages
before it, or a synthesized prompt's index); the file name's fingerprint hashes how (target, model name,
sampling settings), so a journal written with other settings is never read. Lines are written whole with one
`os.write` on an O_APPEND descriptor (a killed process loses none it wrote) and fsync'd every `sync_every`
lines or `sync_s` seconds and at close (a power cut loses at most those). A torn last line (kill -9 or a crash
mid-write) is cut off when the journal is opened; a damaged line before the last is refused in one line.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from pipeline.errors import UserError
from pipeline.fingerprint import digest


def key(*parts) -> str:
    return digest(list(parts))


class Journal:
    def __init__(self, folder: Path, fingerprint: str, sync_every: int = 64, sync_s: float = 2.0):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"regenerate-{fingerprint}.jsonl"
        self.others = sorted(p.name for p in folder.glob("regenerate-*.jsonl") if p != self.path)
        self.done: dict[str, dict] = {}
        self.torn = self._read()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self._unsynced, self._synced_at = 0, time.monotonic()
        self.sync_every, self.sync_s = sync_every, sync_s

    def _read(self) -> bool:
        """Load the committed lines; cut a torn last line off the file. True if one was cut."""
        if not self.path.exists():
            return False
        data = self.path.read_bytes()
        good = data.rfind(b"\n") + 1  # a last line without its newline was never completely written
        lines = data[:good].split(b"\n")[:-1]
        for n, line in enumerate(lines, 1):
            try:
                rec = json.loads(line)
                self.done[rec["key"]] = rec
            except (ValueError, KeyError, TypeError):
                if n < len(lines):
                    raise UserError(
                        f"{self.path}: line {n} is damaged (not a journal record); delete the file "
                        "to regenerate from scratch"
                    ) from None
                good -= len(line) + 1  # a complete but garbled last line: torn too
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
            return True
        return False

    def get(self, k: str) -> dict | None:
        return self.done.get(k)

    def commit(self, k: str, text: str, tokens: int) -> None:
        rec = {"key": k, "text": text, "tokens": tokens}
        line = (json.dumps(rec, ensure_ascii=False) + "\n").encode()
        with self._lock:
            if self._fd < 0:
                return  # closed on the way out (Ctrl-C): a reply still arriving is simply not committed
            while line:  # a regular file takes it whole; the loop covers a short write all the same
                line = line[os.write(self._fd, line) :]
            self.done[k] = rec
            self._unsynced += 1
            if self._unsynced >= self.sync_every or time.monotonic() - self._synced_at >= self.sync_s:
                self._sync()

    def _sync(self) -> None:
        os.fsync(self._fd)
        self._unsynced, self._synced_at = 0, time.monotonic()

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                self._sync()
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
