"""Generation through an OpenAI-compatible endpoint (SGLang, vLLM, any server): one httpx client per thread,
retries with backoff then a count, a progress line, and the regeneration of every assistant turn of the
conversations over such an endpoint, journaled so a killed run resumes."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from pipeline.data.journal import Journal, key
from pipeline.errors import UserError
from pipeline.fingerprint import digest
from pipeline.serving.clients import ThreadClients

log = logging.getLogger(__name__)


def prompt_too_long(tok, messages: list[dict], max_len: int, lock=None) -> bool:
    """The chat-templated prompt holds max_len tokens or more: its answer would be cut away from the sample,
    and a server refuses a prompt past its context. Checked on the prompt as sent (after earlier turns were
    regenerated);
    data/chat_tokens.cut_long_prompts already checked every first turn."""
    import contextlib

    with lock or contextlib.nullcontext():  # a fast tokenizer is not to be shared by threads unguarded
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tok(text, add_special_tokens=False)["input_ids"]) >= max_len


def _first_answer(msgs: list[dict]) -> int:
    return next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), -1)


def turn_key(conv: dict, i: int) -> str:
    return key("turn", conv["source_id"], i, digest(conv["messages"][:i]))


class Failed(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


class EndpointClient:
    """POSTs to an OpenAI-compatible server with retries and backoff; counts requests, retries, empties, and
    notices a server that went away (it then stops asking instead of retrying every remaining request)."""

    def __init__(self, p, base: str, model: str, tok):

        self.base, self.model, self.tok, self.p = base.rstrip("/"), model, tok, p
        self.lock = threading.Lock()
        self._clients = ThreadClients(p.endpoint_timeout_s)
        self.counts = Counter()  # requests, retries, empty_replies
        self.down = threading.Event()
        self.probe_or_fail()

    @property
    def http(self):
        """This thread's own httpx client (pipeline/serving/clients.py says why not one shared client)."""
        return self._clients.get()

    def probe_or_fail(self) -> None:
        """An endpoint that answers nothing at all (any HTTP status is an answer) is one line, before any
        work."""
        if not self.reachable():
            raise UserError(
                f"regenerate endpoint {self.base}: not reachable ({self.why_down}); is the server running?"
            )

    def reachable(self) -> bool:
        import httpx

        try:
            self.http.get(self.base + "/v1/models", timeout=min(10.0, self.p.endpoint_timeout_s))
            return True
        except httpx.HTTPError as e:
            self.why_down = f"{type(e).__name__}: {e}"
            return False

    def _count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] += n

    def tokens_of(self, text: str) -> int:
        with self.lock:  # a fast tokenizer is not to be shared by threads unguarded
            return len(self.tok(text, add_special_tokens=False)["input_ids"])

    def chat(self, messages: list[dict], seed: int | None) -> tuple[str, int]:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.p.max_new_tokens,
            "temperature": self.p.temperature,
        }
        return self.post(
            "/v1/chat/completions",
            body | ({"seed": seed} if seed is not None else {}),
            lambda j: j["choices"][0]["message"]["content"],
        )

    def complete(
        self, prompt: str, max_tokens: int, temperature: float, seed: int, stop: list[str]
    ) -> tuple[str, int]:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
            "stop": stop,
        }
        return self.post("/v1/completions", body, lambda j: j["choices"][0]["text"])

    def post(self, path: str, body: dict, text_of) -> tuple[str, int]:
        """(text, completion tokens); raises Failed(reason) after the retries."""
        failure = Failed("endpoint down")
        for attempt in range(self.p.endpoint_retries + 1):
            if self.down.is_set():
                raise failure if attempt else Failed("endpoint down")
            if attempt:
                self._count("retries")
                time.sleep(self.p.endpoint_backoff_s * 2 ** (attempt - 1))
            try:
                return self._once(path, body, text_of)
            except Failed as e:
                failure = e
                if e.reason.startswith("HTTP 4") and e.reason != "HTTP 429":
                    # the request itself is refused (too long, bad model name): asking again changes nothing
                    break
        if failure.reason == "transport error" and not self.reachable():
            self.down.set()
        raise failure

    def _once(self, path: str, body: dict, text_of) -> tuple[str, int]:
        import httpx

        self._count("requests")
        try:
            r = self.http.post(self.base + path, json=body)
        except httpx.TransportError as e:
            raise Failed("transport error", f"{type(e).__name__}: {e}") from None
        if r.status_code != 200:
            kind = "HTTP 5xx" if r.status_code >= 500 else f"HTTP {r.status_code}"
            raise Failed(kind, r.text[:200])
        try:
            j = r.json()
            text = text_of(j)
            if not isinstance(text, str) and text is not None:
                raise TypeError(type(text).__name__)
        except (ValueError, KeyError, IndexError, TypeError):
            raise Failed("not an OpenAI answer", r.text[:200]) from None
        text = (text or "").strip()
        if not text:
            self._count("empty_replies")
            raise Failed("empty reply")
        usage = j.get("usage") if isinstance(j, dict) else None
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        return text, int(tokens) if isinstance(tokens, int) else self.tokens_of(text)

    def close(self) -> None:
        self._clients.close()


class Progress:
    """tqdm in completion tokens per second; conversations done in its postfix."""

    def __init__(self, desc: str, total_items: int):
        self.bar = tqdm(desc=desc, unit="tok", unit_scale=True, mininterval=1.0)
        self.lock, self.items, self.total_items, self.tokens = threading.Lock(), 0, total_items, 0
        self.started = time.monotonic()

    def add(self, tokens: int = 0, items: int = 0) -> None:
        with self.lock:
            self.tokens += tokens
            self.items += items
            self.bar.update(tokens)
            if items:
                self.bar.set_postfix_str(f"{self.items}/{self.total_items}", refresh=False)

    def close(self) -> dict:
        self.bar.close()
        wall = time.monotonic() - self.started
        return {
            "completion_tokens": self.tokens,
            "wall_s": round(wall, 3),
            "tokens_per_s": round(self.tokens / wall, 1) if wall > 0 else 0.0,
        }


def over_endpoint(cfg, client: EndpointClient, convs: list[dict], journal: Journal) -> dict:
    p = cfg.prepare
    progress = Progress("prepare|regenerate", len(convs))
    tally, failed, lock = Counter(), {}, threading.Lock()  # failed: id(conv) -> reason

    def one(conv: dict) -> None:
        msgs = conv["messages"]
        first = _first_answer(msgs)
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            k = turn_key(conv, i)
            rec = journal.get(k)
            if rec is None and i > first and prompt_too_long(client.tok, msgs[:i], p.max_len, client.lock):
                conv["messages"] = msgs[:i]  # this turn and the ones after it are never asked, counted below
                with lock:
                    tally["cut_long"] += 1
                break
            if rec is None:
                seed = int(key(k, cfg.seed)[:8], 16) if p.temperature > 0 else None
                try:
                    text, tokens = client.chat(msgs[:i], seed)
                except Failed as e:
                    failed[id(conv)] = e.reason
                    return
                journal.commit(k, text, tokens)
                rec = {"text": text}
                progress.add(tokens)
            with lock:
                tally["from_journal"] += "key" in rec
                tally["replaced"] += 1
            msgs[i] = {"role": "assistant", "content": rec["text"]}
        progress.add(items=1)

    pool, finished = ThreadPoolExecutor(p.endpoint_concurrency), False
    try:
        for f in [pool.submit(one, c) for c in convs]:
            f.result()
        finished = True
    finally:  # Ctrl-C, SIGTERM, a bug: queued conversations are not started, in-flight ones not waited for
        if not finished:
            client.down.set()
        pool.shutdown(wait=finished, cancel_futures=True)
        client.close()
        figures = progress.close()
    stats = {
        "backend": f"endpoint {client.base}",
        "turns_replaced": tally["replaced"],
        "cut_at_a_long_prompt": tally["cut_long"],
        "turns_from_journal": tally["from_journal"],
        **figures,
        "requests": client.counts["requests"],
        "retries": client.counts["retries"],
        "empty_replies": client.counts["empty_replies"],
        "failures": dict(sorted(Counter(failed.values()).items())),
        "dropped_conversations": 0,
    }
    if failed:
        _settle_failures(p, client, convs, failed, stats, journal)
    return stats


def _settle_failures(p, client, convs, failed: dict, stats: dict, journal: Journal) -> None:
    counts = ", ".join(f"{n} {r}" for r, n in stats["failures"].items())
    if p.on_failed_request == "drop":
        convs[:] = [c for c in convs if id(c) not in failed]
        stats["dropped_conversations"] = len(failed)
        log.warning(
            "regenerate: %d conversations dropped (%s; prepare.on_failed_request=drop)", len(failed), counts
        )
        return
    down = "; the endpoint stopped answering, is the server running?" if client.down.is_set() else ""
    raise UserError(
        f"regenerate endpoint {client.base}: {len(failed)} of {len(convs)} conversations not finished "
        f"after {p.endpoint_retries} retries per request ({counts}){down}; {len(journal.done)} replies "
        f"are committed in {journal.path}: rerun the same command to resume (nothing committed is "
        "lost), or set prepare.on_failed_request=drop to drop those conversations"
    )
