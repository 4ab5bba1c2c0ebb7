"""A running server as the online bench meets it: which engine it is, what it says of itself (its speculative
settings, CUDA graphs, its counters), one /generate request, and whether two servers are like for like."""

from __future__ import annotations

import logging
import re

from pipeline.errors import UserError

log = logging.getLogger(__name__)


VLLM_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


# what an SGLang server says it runs (/get_server_info): recorded beside each bench, so a speedup is read
# against the settings that made it (CUDA graphs off cost a 135M target 10x on the H200: BENCHMARKS.md, SGLang
# for real)
SGLANG_FACTS = (
    "version",
    "model_path",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "attention_backend",
    "disable_cuda_graph",
    "cuda_graph_max_bs",
)


class BadAnswer(UserError):
    """A server answered HTTP 200 with what eaglepipe cannot read: not UTF-8, not JSON, no completion."""


def shown(content: bytes) -> str:
    """A server's answer as one short phrase: what it is and its first bytes."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        return f"bytes that are not UTF-8 ({content[:40]!r}, {len(content)} bytes)"
    return repr(text[:120]) + (f" ({len(content)} bytes)" if len(text) > 120 else "")


def answer_json(r, url: str, request: str):
    """The JSON of a server's answer, or one line naming the endpoint, the request and what it answered."""
    try:
        return r.json()
    except ValueError:  # not JSON, or not UTF-8 (UnicodeDecodeError is a ValueError)
        raise BadAnswer(
            f"{url}: {request} answered {shown(r.content)}, not JSON: is it an SGLang or vLLM server?"
        ) from None


def detect_engine(client, url: str) -> str:
    if client.get(url + "/get_server_info").status_code == 200:
        return "sglang"
    if client.get(url + "/metrics").status_code == 200 and "vllm:" in client.get(url + "/metrics").text:
        return "vllm"
    raise UserError(f"{url} answers neither SGLang's /get_server_info nor vLLM's /metrics")


def vllm_counters(client, url: str) -> dict:
    """Sum of each spec-decode counter over label sets (one per engine); per-position counters by position."""
    out: dict = {"per_pos": {}}
    for line in client.get(url + "/metrics").text.splitlines():
        m = re.match(r"vllm:spec_decode_(num_\w+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "num_accepted_tokens_per_pos":
            pos = int(re.search(r'position="(\d+)"', labels).group(1))
            out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + value
        elif name in VLLM_COUNTERS:
            out[name] = out.get(name, 0.0) + value
    return out


def server_facts(client, url: str, engine: str) -> dict:
    """The server's own account of what it runs: SGLang's /get_server_info (SGLANG_FACTS), vLLM's /version. A
    vLLM server that will not say is recorded as such; SGLang's answer, which the engine was told by, must be
    a JSON object (else one line naming what it answered)."""
    import httpx

    if engine == "sglang":
        r = client.get(url + "/get_server_info")
        info = answer_json(r, url, "GET /get_server_info")
        if not isinstance(info, dict):
            raise BadAnswer(f"{url}: GET /get_server_info answered {shown(r.content)}, not a JSON object")
        return {k: info.get(k) for k in SGLANG_FACTS}
    try:
        r = client.get(url + "/version")
        return {"version": r.json().get("version")} if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def speedup_note(spec: dict, base: dict, speedup: float | None) -> str | None:
    """One line when speculation made the server slower, saying what the recorded settings (bench's `server`)
    point to."""
    if speedup is None or speedup >= 1:
        return None
    graphs = (spec["server"].get("disable_cuda_graph"), base["server"].get("disable_cuda_graph"))
    if graphs == (True, False):
        why = (
            "the speculative server runs without CUDA graphs and the baseline with them, so this is not "
            "like for like"
        )
    elif graphs == (True, True):
        why = (
            "neither server runs CUDA graphs: a small target is launch-bound, and each round adds the "
            "draft's "
            "steps and a verify pass"
        )
    else:
        why = "the accepted tokens do not pay for the draft's steps on this server"
    at = f", accept length {spec['accept_length']:.2f}" if spec.get("accept_length") else ""
    return f"the speculative server is slower than the baseline (x{speedup:.2f}{at}): {why}"


def generate_one(client, url: str, engine: str, model: str | None, prompt: list[int], max_new: int) -> dict:
    if engine == "sglang":
        r = client.post(
            url + "/generate",
            json={"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}},
        )
    else:
        r = client.post(
            url + "/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": max_new, "temperature": 0.0},
        )
    if r.status_code != 200:
        raise UserError(f"{url}: HTTP {r.status_code}: {r.text[:200]}")
    request = "POST /generate" if engine == "sglang" else "POST /v1/completions"
    out = _completion(engine, answer_json(r, url, request))
    if out is None:
        want = "text, meta_info.completion_tokens" if engine == "sglang" else "choices[0].text, usage"
        raise BadAnswer(f"{url}: {request} answered {shown(r.content)}, which holds no completion ({want})")
    return out


def _completion(engine: str, body) -> dict | None:
    """Tokens, verify passes and text of one answer; None: it holds no completion."""
    if not isinstance(body, dict):
        return None
    if engine == "sglang":  # {"text", "meta_info": {"completion_tokens", "spec_verify_ct", ...}}
        meta = body.get("meta_info") if isinstance(body.get("meta_info"), dict) else {}
        tokens, verify, text = (
            meta.get("completion_tokens"),
            meta.get("spec_verify_ct") or 0,
            body.get("text"),
        )
    else:  # OpenAI's: {"choices": [{"text"}], "usage": {"completion_tokens"}}
        choices, usage = body.get("choices"), body.get("usage")
        first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        verify, text = 0, first.get("text")
    if isinstance(tokens, int) and isinstance(verify, int) and isinstance(text, str):
        return {"completion_tokens": tokens, "verify_ct": verify, "text": text}
    return None


def connect(client, url: str) -> tuple[str, str | None]:
    """(engine, served model name: vLLM's completions need it) of the server at url; unreachable: one line."""
    import httpx

    try:
        engine = detect_engine(client, url)
    except httpx.HTTPError as e:
        raise UserError(f"eval endpoint {url}: {type(e).__name__}: {e}; is the server running?") from None
    return engine, served_model(client, url)["id"] if engine == "vllm" else None


def served_model(client, url: str) -> dict:
    """The first row of an OpenAI-compatible server's /v1/models (id: the name requests give; root: the
    target's path)."""
    r = client.get(url + "/v1/models")
    body = answer_json(r, url, "GET /v1/models")
    rows = body.get("data") if isinstance(body, dict) else None
    if not (isinstance(rows, list) and rows and isinstance(rows[0], dict) and "id" in rows[0]):
        raise BadAnswer(
            f"{url}: GET /v1/models answered {shown(r.content)}, which names no model (data[0].id)"
        )
    return rows[0]


def describe(client, url: str) -> dict:
    """What a server is, read before any request: engine, served model name, the target it serves (SGLang's
    model_path, vLLM's /v1/models root), whether it speculates (SGLang: speculative_algorithm; vLLM:
    spec-decode
    counters at /metrics) and its own settings."""
    engine, model = connect(client, url)
    facts = server_facts(client, url, engine)
    if engine == "sglang":
        target, speculates = facts.get("model_path"), bool(facts.get("speculative_algorithm"))
    else:
        row = served_model(client, url)
        target, speculates = (
            row.get("root") or row.get("id"),
            "vllm:spec_decode_" in client.get(url + "/metrics").text,
        )
    return {
        "endpoint": url,
        "engine": engine,
        "model": model,
        "target": target,
        "speculates": speculates,
        "server": facts,
    }


class NotLikeForLike(UserError):
    """A pair of servers whose speedup would not mean what it says; `side`: the server at fault (speculative,
    baseline) or both (pair)."""

    def __init__(self, side: str, message: str):
        super().__init__(message)
        self.side = side


def like_for_like(spec: dict, base: dict | None) -> None:
    """Refuse, in one line naming the fix, a pair of servers whose speedup would not mean what it says."""
    if not spec["speculates"]:
        raise NotLikeForLike(
            "speculative",
            f"eval.endpoint {spec['endpoint']} serves without speculative settings ({spec['engine']} "
            "reports no speculative algorithm): start it with the export's serve.sh (EAGLE3 and the draft), "
            "or give "
            "that server as eval.baseline_endpoint",
        )
    if base is None:
        return
    if base["speculates"]:
        raise NotLikeForLike(
            "baseline",
            f"eval.baseline_endpoint {base['endpoint']} is itself speculative ({base['engine']} reports a "
            "speculative algorithm): start the baseline from serve.sh without the --speculative-* flags (the "
            "same "
            "target, plain decoding)",
        )
    if spec["target"] and base["target"] and spec["target"].rstrip("/") != base["target"].rstrip("/"):
        raise NotLikeForLike(
            "pair",
            f"the two servers serve different targets ({spec['endpoint']}: {spec['target']}; "
            f"{base['endpoint']}: {base['target']}): start the baseline with the speculative server's "
            "--model-path",
        )
    if not (spec["target"] and base["target"]):
        log.warning(
            "online: a server does not say which target it serves (%s: %s, %s: %s): the speedup assumes "
            "the same one",
            spec["endpoint"],
            spec["target"],
            base["endpoint"],
            base["target"],
        )
