"""The speculative settings chosen by measurement (`eaglepipe tune-serve`, docs/serving.md).

Every candidate of the grid (num_steps x topk x num_draft_tokens x attention backend x CUDA-graph max batch)
is started from the export's own launch line (pipeline/serving/launch.py) with its settings, as its own
process group, waited for, run through the firm bench (pipeline/serving/bench.py: warm-up, repeats interleaved
with one baseline server, median and spread per concurrency) and stopped. The winner is the candidate with the
highest median speculative tokens/s at the objective concurrency among those whose bench completed like for
like; a candidate that fails to start, is refused, runs other settings than asked, or dies mid-bench is in the
table with its reason and never chosen.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import UserError
from pipeline.serving import bench as online
from pipeline.serving import endpoint, launch, server

log = logging.getLogger(__name__)
AXES = ("num_steps", "topk", "num_draft_tokens", "attention_backend", "cuda_graph_max_bs")
FLAGS = {"attention_backend": "--attention-backend", "cuda_graph_max_bs": "--cuda-graph-max-bs"}
# what SGLang's /get_server_info calls each setting: a candidate whose server reports another value did not
# run
REPORTED = {
    "num_steps": "speculative_num_steps",
    "topk": "speculative_eagle_topk",
    "num_draft_tokens": "speculative_num_draft_tokens",
    "attention_backend": "attention_backend",
    "cuda_graph_max_bs": "cuda_graph_max_bs",
}


@dataclass
class Bench:
    """The firm bench's settings (eval.*) and the prompts."""

    prompts: list[list[int]]
    max_new_tokens: int
    concurrency: list[int]
    repeats: int
    warmup_prompts: int
    timeout_s: float


@dataclass
class Plan:
    """What to sweep: the export's target and draft path, its serve settings, the grid, how to start
    servers."""

    target: str
    draft: str
    serve: dict  # launch.settings of the export as it is
    grid: dict  # axis -> list of values (None: serve.sh's own)
    objective_concurrency: int
    work_dir: Path  # servers' logs
    launch_prefix: str | None = None
    server_args: list[str] = field(default_factory=list)
    baseline_endpoint: str | None = None
    start_timeout_s: float = 900.0


def candidates(grid: dict) -> tuple[list[dict], list[dict]]:
    """(candidates, skipped): every combination of the grid's axes; num_draft_tokens None = num_steps + 1. At
    topk 1 SGLang runs num_steps + 1 draft tokens whatever is asked, so other values there are skipped."""
    out, skipped, seen = [], [], set()
    for values in itertools.product(*(list(grid[a]) for a in AXES)):
        c = dict(zip(AXES, values))
        c["num_draft_tokens"] = c["num_draft_tokens"] or c["num_steps"] + 1
        if c["topk"] == 1 and c["num_draft_tokens"] != c["num_steps"] + 1:
            skipped.append({"settings": c, "reason": "SGLang runs topk 1 with num_steps + 1 draft tokens"})
            continue
        key = tuple(c.values())
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out, skipped


def serve_of(base: dict, c: dict) -> dict:
    """The export's serve settings with a candidate's: the speculative numbers, the flags of the other
    axes."""
    args = base["sglang_args"]
    for axis, flag in FLAGS.items():
        args = launch.with_flag(args, flag, c[axis])
    return {**base, **{k: c[k] for k in launch.SPEC_KEYS}, "sglang_args": args}


def _argv(plan: Plan, line: str, port: int) -> list[str]:
    return launch.argv_of(
        line, plan.launch_prefix, ["--host", "127.0.0.1", "--port", str(port), *plan.server_args]
    )


def run(plan: Plan, bench: Bench) -> dict:
    """The sweep's table: every candidate's result (or reason), the winner's index (None: no valid candidate).
    Every server it started is stopped on the way out, SIGTERM and Ctrl-C included."""
    with server.sigterm_unwinds():
        return _run(plan, bench)


def _run(plan: Plan, bench: Bench) -> dict:
    cands, skipped = candidates(plan.grid)
    table = {
        "objective": {"concurrency": plan.objective_concurrency, "by": "median speculative tokens/s"},
        "bench": {
            "prompts": len(bench.prompts),
            "max_new_tokens": bench.max_new_tokens,
            "concurrency": bench.concurrency,
            "repeats": bench.repeats,
            "warmup_prompts": bench.warmup_prompts,
        },
        "export_serve": plan.serve,
        "skipped": skipped,
        "candidates": [],
        "winner": None,
    }
    base_server, base_url = None, plan.baseline_endpoint
    if base_url is None:
        port = server.free_port()
        argv = _argv(plan, launch.plain_command(plan.target, plan.serve), port)
        base_server, reason = server.start(argv, port, plan.work_dir / "baseline.log", plan.start_timeout_s)
        if reason:
            raise UserError(
                f"tune-serve: the baseline server {reason}; fix its launch (tune.launch_prefix, "
                "tune.server_args) or give a running one as tune.baseline_endpoint"
            )
        base_url = base_server.url
    table["baseline"] = {"endpoint": base_url, "launch": base_server.argv if base_server else None}
    try:
        for i, c in enumerate(cands):
            log.info("tune-serve: candidate %d of %d: %s", i + 1, len(cands), c)
            row = _candidate(plan, bench, c, base_url, i)
            table["candidates"].append(row)
            if row.get("abort"):  # the baseline's fault: every later candidate would fail the same way
                table["error"] = row.pop("abort")
                break
    finally:
        if base_server:
            server.stop(base_server)
    table["winner"] = None if "error" in table else choose(table["candidates"], plan.objective_concurrency)
    return table


def _candidate(plan: Plan, bench: Bench, c: dict, base_url: str, i: int) -> dict:
    """One candidate: started, benched, stopped; its row (status ok, or the reason it cannot be chosen)."""
    serve = serve_of(plan.serve, c)
    port = server.free_port()
    argv = _argv(plan, launch.serve_command("sglang", plan.target, Path(plan.draft), serve), port)
    row = {"settings": c, "serve": serve, "launch": argv, "status": "ok"}
    srv, reason = server.start(argv, port, plan.work_dir / f"candidate_{i:02d}.log", plan.start_timeout_s)
    try:
        if reason:
            return {**row, "status": "failed at start", "reason": reason}
        try:
            report = online.firm_bench(
                srv.url,
                base_url,
                bench.prompts,
                bench.max_new_tokens,
                bench.concurrency,
                bench.repeats,
                bench.warmup_prompts,
                bench.timeout_s,
            )
        except endpoint.NotLikeForLike as e:
            out = {**row, "status": "refused", "reason": str(e)}
            return out if e.side == "speculative" else {**out, "abort": str(e)}
        row["report"] = report
        if "error" in report:
            died = report.get("failed_side") != "baseline"
            tail = srv.log_tail() if died else ""
            why = report["error"] + (f"; its log ends: {tail}" if tail else "")
            return {
                **row,
                "status": "died mid-bench" if died else "baseline failed",
                "reason": why,
                **({} if died else {"abort": f"the baseline stopped answering: {report['error']}"}),
            }
        other = {
            k: (v, report["speculative"]["server"].get(REPORTED[k]))
            for k, v in c.items()
            if v is not None and report["speculative"]["server"].get(REPORTED[k]) not in (None, v)
        }
        if other:
            return {
                **row,
                "status": "ran other settings",
                "reason": "the server reports "
                + ", ".join(f"{k}={got} (asked {want})" for k, (want, got) in other.items()),
            }
        return {**row, **objective(report, plan.objective_concurrency)}
    finally:
        server.stop(srv)


def objective(report: dict, concurrency: int) -> dict:
    """The figures a candidate is ranked by, at one concurrency."""
    row = report["by_concurrency"][str(concurrency)]
    spec = row["speculative"]
    return {
        "tokens_per_s": spec["median"],
        "tokens_per_s_spread": spec["spread"],
        "speedup": row.get("speedup_median"),
        "speedup_spread": row.get("speedup_spread"),
        "accept_length": spec["accept_length"],
    }


def choose(rows: list[dict], concurrency: int) -> int | None:
    """The index of the fastest valid candidate (median tokens/s at the objective concurrency); None if
    none."""
    valid = [i for i, r in enumerate(rows) if r["status"] == "ok" and r.get("tokens_per_s") is not None]
    return max(valid, key=lambda i: rows[i]["tokens_per_s"]) if valid else None


def format_table(table: dict) -> str:
    c = table["objective"]["concurrency"]
    lines = [
        f"{'':>3}{'steps':>6}{'topk':>5}{'draft':>6}{'backend':>10}{'graph bs':>9}{'tok/s@' + str(c):>11}"
        f"{'spread':>8}{'speedup':>9}{'accept':>8}  status"
    ]
    for i, r in enumerate(table["candidates"]):
        s = r["settings"]
        figures = (
            (
                f"{r['tokens_per_s']:>11.1f}{r['tokens_per_s_spread'] or 0:>8.1%}"
                f"{r['speedup'] if r['speedup'] is not None else float('nan'):>9.2f}"
                f"{r['accept_length'] or float('nan'):>8.2f}"
            )
            if r["status"] == "ok"
            else f"{'':>36}"
        )
        mark = "*" if i == table["winner"] else " "
        lines.append(
            f"{mark:>3}{s['num_steps']:>6}{s['topk']:>5}{s['num_draft_tokens']:>6}"
            f"{str(s['attention_backend'] or '-'):>10}{str(s['cuda_graph_max_bs'] or '-'):>9}{figures}  "
            f"{r['status']}{': ' + r['reason'] if r.get('reason') else ''}"
        )
    return "\n".join(lines)
