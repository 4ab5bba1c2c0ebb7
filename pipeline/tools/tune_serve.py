"""`eaglepipe tune-serve run_dir=... [export_dir=...] [tune.grid.num_steps=[1,2,3]]
[eval.concurrency=[1,8,32]]`:
the export's speculative settings chosen by measurement on this machine's own server (docs/serving.md).

Sweeps tune.grid on the SGLang export (pipeline/serving/sweep.py): each candidate started from the export's
launch line with its settings, the firm bench of eval.* against one baseline server (started once from
serve.sh without the speculative flags, or tune.baseline_endpoint), the fastest valid one by median tokens/s
at tune.objective_concurrency. Writes run_dir/tune/serve_sweep.json (the table it chose from; servers' logs
beside it) and rewrites the export's serve.sh and export_manifest.json's `serve` (chosen_by: measurement, the
table's path) through the writer export uses (pipeline/serving/launch.py). A later stage=export that runs
again writes export.serve's settings back: put the winner there (the log prints the overrides).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pipeline.acceptance.prompts import heldout_prompts
from pipeline.capture import features
from pipeline.data import prompt_sets
from pipeline.errors import UserError
from pipeline.formats import export_layouts as lay
from pipeline.formats.run_dir import RunDir
from pipeline.serving import launch, sweep

log = logging.getLogger(__name__)


def check(cfg) -> None:
    """Every problem with the tune and bench settings, in one line, before any server starts."""
    t, e, problems = cfg.tune, cfg.eval, []
    if cfg.engine not in (None, "sglang"):
        problems.append(
            f"engine={cfg.engine}: tune-serve sweeps SGLang's settings only; drop engine= or use sglang"
        )
    if t.objective_concurrency not in e.concurrency:
        problems.append(
            f"tune.objective_concurrency={t.objective_concurrency} is not one of eval.concurrency="
            f"{list(e.concurrency)}: add it there or pick one of them"
        )
    for axis in sweep.AXES:
        values = list(t.grid[axis])
        if not values:
            problems.append(f"tune.grid.{axis} is empty: give at least one value (null = serve.sh's own)")
        if any(v is not None and isinstance(v, int) and v < 1 for v in values):
            problems.append(f"tune.grid.{axis}={values}: values must be >= 1")
    if any(v is None for v in t.grid.num_steps) or any(v is None for v in t.grid.topk):
        problems.append("tune.grid.num_steps and tune.grid.topk take numbers, not null")
    if not e.concurrency or min(e.concurrency) < 1 or e.repeats < 1 or e.warmup_prompts < 0:
        problems.append(
            f"eval.concurrency={list(e.concurrency)}, eval.repeats={e.repeats}, eval.warmup_prompts="
            f"{e.warmup_prompts}: concurrencies and repeats >= 1, warm-up >= 0"
        )
    second = [n for n in e.sets if n in prompt_sets.SECOND_TURN]
    if second:
        problems.append(
            f"eval.sets={list(e.sets)}: tune-serve benches first-turn sets only; drop {', '.join(second)}"
        )
    if problems:
        raise UserError("; ".join(problems))


def export_folder(cfg) -> Path:
    folder = Path(cfg.export_dir) if cfg.export_dir else RunDir.of(cfg).export("sglang")
    manifest = folder / lay.MANIFEST
    if not manifest.is_file() or not (folder / "serve.sh").is_file():
        raise UserError(
            f"no SGLang export in {folder} (export_manifest.json and serve.sh): run stage=export "
            "with export.engines including sglang, or point export_dir= at one"
        )
    if json.loads(manifest.read_text()).get("engine") != "sglang":
        raise UserError(f"{folder} is not an SGLang export: tune-serve sweeps SGLang's settings")
    return folder


def bench_prompts(cfg) -> list[list[int]]:
    """The selection half of the held-out samples (prompt_sets.selection_and_report), never the prompts
    evaluate
    reports on: the winner is the best of noisy measurements, and measured again on the prompts it won on it
    would
    overstate (the same rule as train.select=tau). eval.sets' standard sets are evaluate's alone."""
    store, e = features.open_source(cfg), cfg.eval
    return heldout_prompts(cfg, store, e.num_prompts, e.prompt_tokens, half="selection")


def run(cfg) -> Path:
    check(cfg)
    folder = export_folder(cfg)
    return tune(cfg, folder, bench_prompts(cfg))


def tune(cfg, folder: Path, prompts: list[list[int]]) -> Path:
    """Sweep, write the table, rewrite the export's serve settings to the winner; the table's path."""
    manifest = json.loads((folder / lay.MANIFEST).read_text())
    if manifest.get("serve"):
        base = launch.settings(manifest["serve"])
    else:
        log.warning(
            "tune-serve: %s records no serve settings (exported before they were): starting from "
            "export.serve",
            folder,
        )
        base = launch.settings(cfg.export.serve)
    line = (folder / "serve.sh").read_text()
    out = RunDir.of(cfg).tune
    t, e = cfg.tune, cfg.eval
    plan = sweep.Plan(
        target=manifest["target_path"],
        draft=launch.flag_value(line, "--speculative-draft-model-path") or str(folder),
        serve=base,
        grid={a: list(t.grid[a]) for a in sweep.AXES},
        objective_concurrency=t.objective_concurrency,
        work_dir=out / "logs",
        launch_prefix=t.launch_prefix,
        server_args=list(t.server_args),
        baseline_endpoint=t.baseline_endpoint,
        start_timeout_s=t.start_timeout_s,
    )
    bench = sweep.Bench(
        prompts, e.max_new_tokens, list(e.concurrency), e.repeats, e.warmup_prompts, e.endpoint_timeout_s
    )
    table = sweep.run(plan, bench)
    table["export"] = str(folder)
    path = out / "serve_sweep.json"
    path.write_text(json.dumps(table, indent=1))
    log.info(
        "tune-serve: %d candidates (* = chosen):\n%s", len(table["candidates"]), sweep.format_table(table)
    )
    if table.get("error"):
        raise UserError(f"tune-serve: {table['error']} (the table so far: {path})")
    if table["winner"] is None:
        raise UserError(
            f"tune-serve: no candidate started and completed its bench (reasons in {path}); serve.sh is "
            "unchanged"
        )
    best = table["candidates"][table["winner"]]
    launch.write_serve(
        folder,
        "sglang",
        manifest["target_path"],
        Path(plan.draft),
        best["serve"],
        {
            "by": "measurement",
            "table": str(path.resolve()),
            "concurrency": t.objective_concurrency,
            "tokens_per_s": best["tokens_per_s"],
            "speedup": best["speedup"],
        },
    )
    s = best["serve"]
    log.info(
        "tune-serve: %s/serve.sh now runs steps %d, topk %d, %d draft tokens%s (%.1f tokens/s at concurrency "
        "%d, "
        "speedup %s); to keep them when export runs again: export.serve.num_steps=%d export.serve.topk=%d "
        "export.serve.num_draft_tokens=%d%s",
        folder,
        s["num_steps"],
        s["topk"],
        s["num_draft_tokens"],
        f", {' '.join(s['sglang_args'])}" if s["sglang_args"] else "",
        best["tokens_per_s"],
        t.objective_concurrency,
        f"x{best['speedup']:.2f}" if best["speedup"] else "n/a",
        s["num_steps"],
        s["topk"],
        s["num_draft_tokens"],
        f" 'export.serve.sglang_args=[{','.join(s['sglang_args'])}]'" if s["sglang_args"] else "",
    )
    return path
