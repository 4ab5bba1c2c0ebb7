"""Online bench (`eaglepipe stage=evaluate eval.endpoint=http://host:port`): a RUNNING server's own counters.

Sends the held-out eval prompts (token ids, so no chat template can differ) to an SGLang or vLLM server that
serves the draft, greedy, and reads the engine's acceptance counters:
- SGLang (`POST /generate` with input_ids): per request `meta_info.completion_tokens` and
  `meta_info.spec_verify_ct` (target verify passes); accept length = completion tokens / verify passes
  (bonus token included), the same definition as offline tau. SGLang is recognised by `GET /get_server_info`.
- vLLM (`POST /v1/completions` with a token-id prompt): Prometheus counters at `GET /metrics`, read before
  and after: `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and
  `..._num_accepted_tokens_per_pos{position=i}`; accept length = 1 + accepted / drafts.

The firm bench (`firm_bench`, docs/serving.md): `eval.warmup_prompts` requests to each server first (not
counted), then per concurrency of `eval.concurrency`, `eval.repeats` passes over every prompt, the two
servers'
passes interleaved (speculative, baseline, speculative, ...) so drift hits both; per concurrency each pass's
tokens/s, the median and spread ((max - min) / median) of each server's tokens/s and of the paired speedup.
Before
any request it refuses, one line each, what is not like for like: a speculative endpoint that does not
speculate,
a baseline that does, two servers of different targets. A server that stops answering mid-bench ends it: the
passes measured before are kept (`error` says which server, where), no speedup is recorded.
Writes run_dir/eval/online.json.
"""

from __future__ import annotations

import json
import logging
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.errors import UserError
from pipeline.serving.clients import ThreadClients

log = logging.getLogger(__name__)
VLLM_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
# what an SGLang server says it runs (/get_server_info): recorded beside each bench, so a speedup is read
# against
# the settings that made it (CUDA graphs off cost a 135M target 10x on the H200: BENCHMARKS.md, SGLang for
# real)
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
SIDES = ("speculative", "baseline")


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


def _generate(client, url: str, engine: str, model: str | None, prompt: list[int], max_new: int) -> dict:
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
    body = r.json()
    if engine == "sglang":
        meta = body.get("meta_info") or {}
        return {
            "completion_tokens": int(meta.get("completion_tokens", 0)),
            "verify_ct": int(meta.get("spec_verify_ct", 0)),
            "text": body.get("text") or "",
        }
    choices = body.get("choices") or [{}]
    return {
        "completion_tokens": int(body["usage"]["completion_tokens"]),
        "verify_ct": 0,
        "text": choices[0].get("text") or "",
    }


def _connect(client, url: str) -> tuple[str, str | None]:
    """(engine, served model name: vLLM's completions need it) of the server at url; unreachable: one line."""
    import httpx

    try:
        engine = detect_engine(client, url)
    except httpx.HTTPError as e:
        raise UserError(f"eval endpoint {url}: {type(e).__name__}: {e}; is the server running?") from None
    return engine, client.get(url + "/v1/models").json()["data"][0]["id"] if engine == "vllm" else None


def describe(client, url: str) -> dict:
    """What a server is, read before any request: engine, served model name, the target it serves (SGLang's
    model_path, vLLM's /v1/models root), whether it speculates (SGLang: speculative_algorithm; vLLM:
    spec-decode
    counters at /metrics) and its own settings."""
    engine, model = _connect(client, url)
    facts = server_facts(client, url, engine)
    if engine == "sglang":
        target, speculates = facts.get("model_path"), bool(facts.get("speculative_algorithm"))
    else:
        row = client.get(url + "/v1/models").json()["data"][0]
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


def spread(values: list[float]) -> dict:
    """median and spread = (max - min) / median of a server's (or a speedup's) repeats."""
    med = statistics.median(values)
    return {"median": med, "spread": (max(values) - min(values)) / med if med else None}


def one_pass(client, server: dict, prompts: list[list[int]], max_new: int, concurrency: int) -> dict:
    """Every prompt through one server at one concurrency: its tokens/s and acceptance counts (one repeat)."""
    url, engine = server["endpoint"], server["engine"]
    before = vllm_counters(client, url) if engine == "vllm" else None
    t0 = time.perf_counter()
    # one client per sending thread (pipeline/serving/clients.py): a shared pool would cap what the bench can
    # ask
    timeout_s = getattr(getattr(client, "timeout", None), "read", None) or 300.0
    with ThreadClients(timeout_s) as clients, ThreadPoolExecutor(concurrency) as pool:
        results = list(
            pool.map(lambda p: _generate(clients.get(), url, engine, server["model"], p, max_new), prompts)
        )
    wall = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] for r in results)
    out = {
        "requests": len(results),
        "completion_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
    }
    if engine == "sglang":
        out["verify_passes"] = sum(r["verify_ct"] for r in results)
    else:
        after = vllm_counters(client, url)
        out.update({k: after.get(k, 0.0) - before.get(k, 0.0) for k in VLLM_COUNTERS})
        out["per_pos"] = {
            i: after["per_pos"].get(i, 0) - before["per_pos"].get(i, 0) for i in sorted(after["per_pos"])
        }
    return out


def acceptance(engine: str, passes: list[dict]) -> dict:
    """Accept length pooled over passes (None: the server did not speculate), vLLM's counts beside it."""
    tokens = sum(p["completion_tokens"] for p in passes)
    if engine == "sglang":
        verify = sum(p["verify_passes"] for p in passes)
        return {"verify_passes": verify, "accept_length": tokens / verify if verify else None}
    drafts = sum(p["num_drafts"] for p in passes)
    out = {
        "drafts": drafts,
        "draft_tokens": sum(p["num_draft_tokens"] for p in passes),
        "accepted": sum(p["num_accepted_tokens"] for p in passes),
        "accept_length": None,
    }
    if drafts:
        out["accept_length"] = 1 + out["accepted"] / drafts
        positions = sorted({i for p in passes for i in p["per_pos"]})
        out["accept_per_position"] = [sum(p["per_pos"].get(i, 0) for p in passes) / drafts for i in positions]
    return out


def firm_bench(
    endpoint: str,
    baseline: str | None,
    prompts: list[list[int]],
    max_new: int,
    concurrency: list[int],
    repeats: int,
    warmup: int,
    timeout_s: float,
) -> dict:
    """The speculative server (and the baseline) over the prompts: warm-up first, then per concurrency
    `repeats`
    interleaved passes. Refuses what is not like for like before any request; a server that stops answering
    ends the bench with `error` set and no speedup (the passes before it are kept)."""
    import httpx

    logging.getLogger("httpx").setLevel(
        logging.WARNING
    )  # not one log line per request: thousands in a firm bench
    urls = {"speculative": endpoint.rstrip("/"), "baseline": baseline.rstrip("/") if baseline else None}
    sides = [s for s in SIDES if urls[s]]
    top = max(concurrency)
    with httpx.Client(
        timeout=timeout_s, limits=httpx.Limits(max_connections=top + 4, max_keepalive_connections=top + 4)
    ) as client:
        report = {
            "bench": {
                "prompts": len(prompts),
                "max_new_tokens": max_new,
                "concurrency": list(concurrency),
                "repeats": repeats,
                "warmup_prompts": warmup,
                "order": " ".join(s[:4] for s in sides),
            }
        }
        servers = {}
        for side in sides:
            try:
                servers[side] = describe(client, urls[side])
            except (UserError, httpx.HTTPError, ValueError, KeyError) as e:
                report.update(
                    failed_side=side, error=f"the {side} server: {str(e)[:300]}; nothing was measured"
                )
                return report
        like_for_like(servers["speculative"], servers.get("baseline"))
        report.update(
            {s: {k: v for k, v in servers[s].items() if k not in ("model", "speculates")} for s in sides},
            by_concurrency={},
        )
        passes = _measure(client, servers, prompts, max_new, concurrency, repeats, warmup, report)
    _summarise(report, servers, passes, concurrency)
    return report


def _measure(client, servers, prompts, max_new, concurrency, repeats, warmup, report) -> dict:
    """The passes, interleaved; each server's per concurrency. A dead server: report['error'], measuring
    stops."""
    import httpx

    passes = {s: {c: [] for c in concurrency} for s in servers}
    where = "warm-up"
    try:
        for server in servers.values():
            warm = [prompts[i % len(prompts)] for i in range(warmup)]
            if warm:
                one_pass(client, server, warm, max_new, min(len(warm), max(concurrency)))
        for c in concurrency:
            if c > len(prompts):
                log.warning(
                    "online: concurrency %d with %d prompts: at most %d requests run at once",
                    c,
                    len(prompts),
                    len(prompts),
                )
            for r in range(repeats):
                for side, server in servers.items():
                    where = f"concurrency {c}, repeat {r + 1} of {repeats}"
                    passes[side][c].append(one_pass(client, server, prompts, max_new, c))
    except (httpx.HTTPError, UserError) as e:
        done = {s: {c: len(p) for c, p in per.items() if p} for s, per in passes.items()}
        report["failed_side"] = side
        report["error"] = (
            f"the {side} server {server['endpoint']} stopped answering at {where} "
            f"({type(e).__name__}: {str(e)[:200]}); measured before it (passes per concurrency): "
            f"{json.dumps(done)}; no speedup is recorded: restart it (its log says why) and run again"
        )
    return passes


def _summarise(report: dict, servers: dict, passes: dict, concurrency: list[int]) -> None:
    """Per concurrency: each pass's tokens/s, median and spread per server, the paired speedup (only when
    every
    pass ran); the pooled accept length per server; the top-level speedup = the first concurrency's median."""
    complete = "error" not in report
    for c in concurrency:
        row = {}
        for side in servers:
            ps = passes[side][c]
            if ps:
                row[side] = {
                    "tokens_per_s": [p["tokens_per_s"] for p in ps],
                    **spread([p["tokens_per_s"] for p in ps]),
                    "accept_length": acceptance(servers[side]["engine"], ps)["accept_length"],
                }
        if complete and "baseline" in servers:
            ratios = [
                a["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else float("inf")
                for a, b in zip(passes["speculative"][c], passes["baseline"][c])
            ]
            stats = spread(ratios)
            row.update(speedup=ratios, speedup_median=stats["median"], speedup_spread=stats["spread"])
        if row:
            report["by_concurrency"][str(c)] = row
    for side in servers:
        every = [p for c in concurrency for p in passes[side][c]]
        first = report["by_concurrency"].get(str(concurrency[0]), {}).get(side)
        report[side].update(
            requests=report["bench"]["prompts"],
            passes=len(every),
            completion_tokens=sum(p["completion_tokens"] for p in every),
            tokens_per_s=first["median"] if first else None,
            **acceptance(servers[side]["engine"], every) if every else {"accept_length": None},
        )
    if complete and "baseline" in servers:
        report["speedup"] = report["by_concurrency"][str(concurrency[0])]["speedup_median"]
        note = speedup_note(report["speculative"], report["baseline"], report["speedup"])
        if note:
            report["speedup_note"] = note


def greedy_answers(cfg, store, prompts: list[list[int]], max_new: int) -> list[str]:
    """The served target's greedy answer to each prompt (text), at most max_new tokens: what evaluate puts
    before
    a second turn (mt_bench_turn2). The same entry shape as offline_bench.greedy_answers."""
    import httpx

    e = cfg.eval
    url = e.endpoint.rstrip("/")
    with httpx.Client(timeout=e.endpoint_timeout_s) as client:
        engine, model = _connect(client, url)
        with ThreadPoolExecutor(max(e.concurrency)) as pool:
            return [
                r["text"].strip()
                for r in pool.map(lambda p: _generate(client, url, engine, model, p, max_new), prompts)
            ]


def measure(cfg, store, prompts: list[list[int]], out: Path) -> Path:
    """The firm bench of eval.endpoint (and eval.baseline_endpoint) over the prompts -> out/online.json. A
    server
    that stopped answering: the passes measured before are written, then one line. `store` is unused: the same
    entry shape as offline_bench.measure."""
    e = cfg.eval
    report = firm_bench(
        e.endpoint,
        e.baseline_endpoint,
        prompts,
        e.max_new_tokens,
        list(e.concurrency),
        e.repeats,
        e.warmup_prompts,
        e.endpoint_timeout_s,
    )
    out.mkdir(parents=True, exist_ok=True)
    path = out / "online.json"
    path.write_text(json.dumps(report, indent=1))
    if "error" in report:
        raise UserError(f"{report['error']} (written to {path})")
    spec = report["speculative"]
    if spec["accept_length"] is None:
        log.warning(
            "online: %s reported no speculative verify passes: is it serving the draft with EAGLE3?",
            e.endpoint,
        )
    if report.get("speedup_note"):
        log.warning("online: %s", report["speedup_note"])
    log.info(
        "online (%s at %s): %d prompts x %d repeats, accept length %s\n%s",
        spec["engine"],
        e.endpoint,
        spec["requests"],
        e.repeats,
        f"{spec['accept_length']:.3f}" if spec["accept_length"] else "n/a",
        table(report),
    )
    return out


def table(report: dict) -> str:
    """The firm bench as a log table: per concurrency each server's median tokens/s and spread, the
    speedup."""
    lines = [
        f"{'concurrency':>12}{'spec tok/s':>12}{'spread':>8}{'base tok/s':>12}{'spread':>8}{'speedup':>9}"
        f"{'spread':>8}"
    ]
    for c, row in report["by_concurrency"].items():
        cells = [f"{c:>12}"]
        for side in SIDES:
            r = row.get(side)
            cells.append(
                f"{r['median']:>12.1f}{r['spread']:>8.1%}" if r and r["spread"] is not None else f"{'':>20}"
            )
        cells.append(
            f"{row['speedup_median']:>9.2f}{row['speedup_spread']:>8.1%}"
            if "speedup_median" in row and row["speedup_spread"] is not None
            else ""
        )
        lines.append("".join(cells))
    return "\n".join(lines)
