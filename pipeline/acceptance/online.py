"""Online bench (`eaglepipe stage=evaluate eval.endpoint=http://host:port`): a RUNNING server's own counters.

Sends the held-out eval prompts (token ids, so no chat template can differ) to an SGLang or vLLM server that
serves the draft, greedy, and reads the engine's acceptance counters:
- SGLang (`POST /generate` with input_ids): per request `meta_info.completion_tokens` and
  `meta_info.spec_verify_ct` (target verify passes); accept length = completion tokens / verify passes
  (bonus token included), the same definition as offline tau. SGLang is recognised by `GET /get_server_info`.
- vLLM (`POST /v1/completions` with a token-id prompt): Prometheus counters at `GET /metrics`, read before
  and after: `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and
  `..._num_accepted_tokens_per_pos{position=i}`; accept length = 1 + accepted / drafts.
Reports pooled accept length, output tokens/s, and with `eval.baseline_endpoint` (the same target served
without speculation) the speedup. Writes run_dir/eval/online.json.
"""

from __future__ import annotations

import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.errors import UserError

log = logging.getLogger(__name__)
VLLM_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
# what an SGLang server says it runs (/get_server_info): recorded beside each bench, so a speedup is read against
# the settings that made it (CUDA graphs off cost a 135M target 10x on the H200: BENCHMARKS.md, SGLang for real)
SGLANG_FACTS = ("version", "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                "speculative_num_draft_tokens", "attention_backend", "disable_cuda_graph")


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
    server that will not say is recorded as such; it never fails the bench."""
    import httpx

    try:
        if engine == "sglang":
            info = client.get(url + "/get_server_info").json()
            return {k: info.get(k) for k in SGLANG_FACTS}
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
        why = "the speculative server runs without CUDA graphs and the baseline with them, so this is not like for like"
    elif graphs == (True, True):
        why = ("neither server runs CUDA graphs: a small target is launch-bound, and each round adds the draft's "
               "steps and a verify pass")
    else:
        why = "the accepted tokens do not pay for the draft's steps on this server"
    at = f", accept length {spec['accept_length']:.2f}" if spec.get("accept_length") else ""
    return f"the speculative server is slower than the baseline (x{speedup:.2f}{at}): {why}"


def _generate(client, url: str, engine: str, model: str | None, prompt: list[int], max_new: int) -> dict:
    if engine == "sglang":
        r = client.post(url + "/generate", json={"input_ids": prompt, "sampling_params": {
            "max_new_tokens": max_new, "temperature": 0.0}})
    else:
        r = client.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_new,
                                                       "temperature": 0.0})
    if r.status_code != 200:
        raise UserError(f"{url}: HTTP {r.status_code}: {r.text[:200]}")
    body = r.json()
    if engine == "sglang":
        meta = body.get("meta_info") or {}
        return {"completion_tokens": int(meta.get("completion_tokens", 0)),
                "verify_ct": int(meta.get("spec_verify_ct", 0)), "text": body.get("text") or ""}
    choices = body.get("choices") or [{}]
    return {"completion_tokens": int(body["usage"]["completion_tokens"]), "verify_ct": 0,
            "text": choices[0].get("text") or ""}


def _connect(client, url: str) -> tuple[str, str | None]:
    """(engine, served model name: vLLM's completions need it) of the server at url; unreachable: one line."""
    import httpx

    try:
        engine = detect_engine(client, url)
    except httpx.HTTPError as e:
        raise UserError(f"eval endpoint {url}: {type(e).__name__}: {e}; is the server running?") from None
    return engine, client.get(url + "/v1/models").json()["data"][0]["id"] if engine == "vllm" else None


def greedy_answers(cfg, store, prompts: list[list[int]], max_new: int) -> list[str]:
    """The served target's greedy answer to each prompt (text), at most max_new tokens: what evaluate puts before
    a second turn (mt_bench_turn2). The same entry shape as offline_bench.greedy_answers."""
    import httpx

    e = cfg.eval
    url = e.endpoint.rstrip("/")
    with httpx.Client(timeout=e.endpoint_timeout_s) as client:
        engine, model = _connect(client, url)
        with ThreadPoolExecutor(e.endpoint_concurrency) as pool:
            return [r["text"].strip() for r in pool.map(lambda p: _generate(client, url, engine, model, p, max_new), prompts)]


def bench(url: str, prompts: list[list[int]], max_new: int, concurrency: int, timeout_s: float) -> dict:
    """Run every prompt through the server at `url`; its throughput and (if it speculates) acceptance."""
    import httpx

    url = url.rstrip("/")
    with httpx.Client(timeout=timeout_s) as client:
        engine, model = _connect(client, url)
        before = vllm_counters(client, url) if engine == "vllm" else None
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(lambda p: _generate(client, url, engine, model, p, max_new), prompts))
        wall = time.perf_counter() - t0
        after = vllm_counters(client, url) if engine == "vllm" else None
        facts = server_facts(client, url, engine)
    tokens = sum(r["completion_tokens"] for r in results)
    report = {"endpoint": url, "engine": engine, "server": facts, "requests": len(results),
              "completion_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
              "accept_length": None}
    if engine == "sglang":
        verify = sum(r["verify_ct"] for r in results)
        report["verify_passes"] = verify
        report["accept_length"] = tokens / verify if verify else None  # None: the server does not speculate
    else:
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in VLLM_COUNTERS}
        drafts = delta["num_drafts"]
        report.update(drafts=drafts, draft_tokens=delta["num_draft_tokens"], accepted=delta["num_accepted_tokens"])
        if drafts:
            report["accept_length"] = 1 + delta["num_accepted_tokens"] / drafts
            report["accept_per_position"] = [(after["per_pos"].get(i, 0) - before["per_pos"].get(i, 0)) / drafts
                                             for i in sorted(after["per_pos"])]
    return report


def measure(cfg, store, prompts: list[list[int]], out: Path) -> Path:
    """The server's accept length (and the speedup over the baseline) over the prompts; out/online.json.
    `store` is unused: the same entry shape as offline_bench.measure."""
    e = cfg.eval
    report = {"speculative": bench(e.endpoint, prompts, e.max_new_tokens, e.endpoint_concurrency, e.endpoint_timeout_s)}
    spec = report["speculative"]
    if spec["accept_length"] is None:
        log.warning("online: %s reported no speculative verify passes: is it serving the draft with EAGLE3?", e.endpoint)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "online.json"
    path.write_text(json.dumps(report, indent=1))  # the speculative half survives a dead baseline
    if e.baseline_endpoint:
        try:
            base = bench(e.baseline_endpoint, prompts, e.max_new_tokens, e.endpoint_concurrency, e.endpoint_timeout_s)
            report["baseline"] = base
            report["speedup"] = spec["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None
            note = speedup_note(spec, base, report["speedup"])
            if note:
                report["speedup_note"] = note
                log.warning("online: %s", note)
        except UserError as err:
            report["baseline_error"] = str(err)
            raise UserError(f"baseline: {err} (the speculative half is saved in {path})") from None
        finally:
            path.write_text(json.dumps(report, indent=1))
    log.info("online (%s at %s): %d requests, %d tokens, %.1f tokens/s, accept length %s%s", spec["engine"],
             e.endpoint, spec["requests"], spec["completion_tokens"], spec["tokens_per_s"],
             f"{spec['accept_length']:.3f}" if spec["accept_length"] else "n/a",
             f", speedup x{report['speedup']:.2f} over {e.baseline_endpoint}" if report.get("speedup") else "")
    return out
