"""HTTP clients for many threads talking to one server: one httpx.Client per thread.

One client shared by hundreds of threads serialises them on its connection pool: on the H200 a regeneration
asking 512 requests of SGLang kept 1-10 running most of the time (BENCHMARKS.md, "Ten times the data"), and a
local test server saw 34 of 512 in flight on average against 139 with a client per thread
(scripts/bench/regenerate_client.py, removed since: `git show a80273c:scripts/bench/regenerate_client.py`).
Regeneration and the online bench both send through this.
"""

from __future__ import annotations

import threading


class ThreadClients:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._local, self._all, self._lock = threading.local(), [], threading.Lock()

    def get(self):
        """This thread's own client (made on first use)."""
        import httpx

        c = getattr(self._local, "client", None)
        if c is None:
            c = self._local.client = httpx.Client(timeout=self.timeout_s)
            with self._lock:
                self._all.append(c)
        return c

    def close(self) -> None:
        with self._lock:
            clients, self._all = self._all, []
        for c in clients:
            c.close()
        self._local = threading.local()

    def __enter__(self) -> ThreadClients:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
