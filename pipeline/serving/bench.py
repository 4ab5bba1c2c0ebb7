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
servers' passes interleaved (speculative, baseline, speculative, ...) so drift hits both; per concurrency each
pass's tokens/s, the median and spread ((max - min) / median) of each server's tokens/s and of the paired
speedup. Before any request it refuses, one line each, what is not like for like: a speculative endpoint that
does not speculate, a baseline that does, two servers of different targets. A server that stops answering
mid-bench ends it: the passes measured before are kept (`error` says which server, where), no speedup is
recorded. Writes run_dir/eval/online.json.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline import intervals
from pipeline.errors import UserError
from pipeline.formats import eval_plots, eval_reports
from pipeline.serving.clients import ThreadClients
from pipeline.serving.endpoint import (
    VLLM_COUNTERS,
    BadAnswer,
    connect,
    describe,
    generate_one,
    like_for_like,
    speedup_note,
    vllm_counters,
)

log = logging.getLogger(__name__)
SIDES = ("speculative", "baseline")


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
            pool.map(lambda p: generate_one(clients.get(), url, engine, server["model"], p, max_new), prompts)
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
        out["by_prompt"] = [[r["completion_tokens"], r["verify_ct"]] for r in results]  # for the interval
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
        out = {"verify_passes": verify, "accept_length": tokens / verify if verify else None}
        if verify and all("by_prompt" in p for p in passes):  # each pass sends the same prompts, in order
            per = [[sum(x) for x in zip(*rows)] for rows in zip(*(p["by_prompt"] for p in passes))]
            out.update(prompts=len(per), accept_length_ci95=intervals.ratio_ci95([tuple(r) for r in per]))
        return out
    drafts = sum(p["num_drafts"] for p in passes)
    out = {
        "drafts": drafts,
        "draft_tokens": sum(p["num_draft_tokens"] for p in passes),
        "accepted": sum(p["num_accepted_tokens"] for p in passes),
        "accept_length": None,
        "accept_length_ci95": None,  # vLLM counts drafts server-wide, not per request: no interval
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
        what, fix = (
            (
                f"gave an answer that is not a completion at {where} ({str(e)[:300]})",
                f"point eval.{'endpoint' if side == 'speculative' else 'baseline_endpoint'} at an SGLang "
                "or vLLM server",
            )
            if isinstance(e, BadAnswer)
            else (
                f"stopped answering at {where} ({type(e).__name__}: {str(e)[:200]})",
                "restart it (its log says why) and run again",
            )
        )
        report["error"] = (
            f"the {side} server {server['endpoint']} {what}; measured before it (passes per concurrency): "
            f"{json.dumps(done)}; no speedup is recorded: {fix}"
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
        engine, model = connect(client, url)
        with ThreadPoolExecutor(max(e.concurrency)) as pool:
            return [
                r["text"].strip()
                for r in pool.map(lambda p: generate_one(client, url, engine, model, p, max_new), prompts)
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
    path = eval_reports.write(out, True, report)
    if report.get("by_concurrency"):  # the passes measured, even those before a server stopped answering
        eval_plots.online(report, out / eval_reports.ONLINE_PNG)
    if "error" in report:
        raise UserError(f"{report['error']} (written to {path})")
    spec = report["speculative"]
    if not spec["completion_tokens"]:  # answers, but not one token: nothing to measure acceptance on
        raise UserError(
            f"the speculative server {e.endpoint} answered {spec['requests']} prompts x {spec['passes']} "
            f"passes with 0 completion tokens (eval.max_new_tokens={e.max_new_tokens}): nothing was measured "
            f"(written to {path})"
        )
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
