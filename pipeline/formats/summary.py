"""The closing summary of `stage=all`: per stage its time and key figure, and the files to open next.

Read only from what the stages wrote (stages.json and each stage's own JSON), so it describes the run
directory as it is on disk, including stages skipped as up to date. Printed with rich and saved as
run_dir/summary.md (the same table in Markdown).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.formats import eval_reports, vocab_map
from pipeline.formats.run_dir import RunDir


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _accs(rec: dict) -> str:
    ks = sorted(int(k.split("_")[-1]) for k in rec if k.startswith("full_acc_"))[:3]
    return "/".join(f"{rec[f'full_acc_{k}']:.3f}" for k in ks)


def figures(run_dir: Path) -> dict[str, str]:
    """One line per stage that has output: what it made, in numbers."""
    r = Path(run_dir)
    out = {}
    if p := _read(RunDir(r).prepared_stats):
        skipped = sum((p.get("skipped_records") or {}).values())
        out["prepare"] = (
            f"{p['samples']:,} samples, {p['tokens']:,} tokens ({p['supervised_tokens']:,} supervised)"
            + (f"; {skipped:,} records skipped" if skipped else "")
            + (_answered(p["regenerate"]) if isinstance(p.get("regenerate"), dict) else "")
        )
    if (m := _read(RunDir(r).features_manifest)) and m.get("shards"):
        f = m["facts"]
        tokens = sum(s["num_tokens"] for s in m["shards"])
        out["extract"] = (
            f"aux layers {f['aux_layer_ids']} + last of {f['num_layers']} (backend {f['backend']}, "
            f"{f['compute_dtype']}); {tokens:,} tokens in {len(m['shards'])} shard(s)"
        )
    if (v := _read(RunDir(r).vocab_manifest)) and (rep := _read(r / "vocab" / vocab_map.REPORT)):
        held = (rep.get("heldout_coverage_by_size") or {}).get(str(v["draft_vocab_size"]))
        out["vocab"] = (
            f"{v['draft_vocab_size']:,} draft ids of {v['target_vocab_size']:,} cover "
            f"{100 * v['coverage']:.2f}% of supervised tokens in-sample"
            + (f", {100 * held:.2f}% held out" if held is not None else "")
            + f" ({rep['distinct_ids_seen']:,} distinct seen)"
        )
    if t := _read(RunDir(r).train_summary):
        out["train"] = (
            f"{t['optimizer_steps']} steps; val acc_0/1/2 {_accs(t['val_before'])} -> {_accs(t['val_after'])}"
        )
    exports = []
    for engine in ("sglang", "vllm"):
        if e := _read(RunDir(r).export_manifest(engine)):
            by = e.get("verified_by")
            exports.append(
                f"{engine}: checks passed, loaded by {by['class']} ({by['engine']} {by['engine_version']})"
                if by
                else f"{engine}: engine-free checks passed (export.verify_in_engine=false)"
            )
    if exports:
        out["export"] = "; ".join(exports)
    if a := _read(r / "eval" / eval_reports.OFFLINE):
        ks = a["draft_lengths"]
        tau = {n: "/".join(f"{a[n][str(k)]['tau']:.2f}" for k in ks) for n in ("trained", "untrained")}
        mism = sum(a[n][str(k)]["greedy_mismatches"] for n in ("trained", "untrained") for k in ks)
        out["evaluate"] = (
            f"tau k={'/'.join(map(str, ks))}: trained {tau['trained']} vs untrained "
            f"{tau['untrained']} ({a['prompts']} prompts; greedy mismatches {mism})"
        )
    return out


def pictures(run_dir: Path) -> list[tuple[str, Path]]:
    """(caption, path) of the run's pictures that exist: training's curves, evaluate's τ and online bench."""
    rd = RunDir(Path(run_dir))
    wanted = [
        ("training and validation curves", rd.train / "plots" / "curves.png"),
        ("τ per draft length, 95 % intervals over prompts", rd.eval / eval_reports.TAU_PNG),
        (
            "online: tokens/s and speedup per concurrency, spread over repeats",
            rd.eval / eval_reports.ONLINE_PNG,
        ),
    ]
    return [(caption, path) for caption, path in wanted if path.exists()]


def files_to_open(run_dir: Path) -> list[str]:
    rd = RunDir(Path(run_dir))
    wanted = [
        *[path for _, path in pictures(run_dir)],
        rd.eval / eval_reports.OFFLINE,
        rd.eval / eval_reports.ONLINE,
        rd.vocab / vocab_map.REPORT,
        rd.export_manifest("sglang"),
        rd.export("sglang") / "serve.sh",
        rd.export("vllm") / "serve.sh",
    ]
    return [str(w) for w in wanted if w.exists()]


def _online(run_dir: Path) -> bool:
    summary = _read(RunDir(Path(run_dir)).train_summary) or {}
    return summary.get("config", {}).get("train", {}).get("features") == "online"


def _answered(r: dict) -> str:
    """How the target's answers came: kept (data/answers/, docs/answers.md) and regenerated, each counted."""
    kept = (r.get("kept_answers") or {}).get("used", 0)
    new = r["turns_replaced"] - r.get("turns_from_journal", 0)  # asked of the engine in this run
    return (
        f"; {kept:,} answers kept, {new:,} regenerated ({r['backend']})"
        if kept
        else (f"; {new:,} turns regenerated ({r['backend']})")
    )


def rows(run_dir: Path, order: list[str], ran: set[str]) -> list[tuple[str, str, str]]:
    """(stage, time, figure) for every stage in the runner's `order`; `ran` = the stages this invocation
    ran."""
    records = _read(RunDir(Path(run_dir)).stages_json) or {}
    figs = figures(run_dir)
    out = []
    for name in order:
        rec = records.get(name)
        if rec is None and name not in figs:
            out.append(
                (
                    name,
                    "-",
                    "skipped: train.features=online, the target ran inside train (no feature store)"
                    if name == "extract" and _online(run_dir)
                    else "not run",
                )
            )
            continue
        secs = f"{rec['seconds']:.1f} s" if rec else "-"
        out.append(
            (
                name,
                secs if name in ran else f"{secs} (up to date, skipped)",
                figs.get(name, "no output found"),
            )
        )
    return out


def markdown(run_dir: Path, table: list[tuple[str, str, str]], files: list[str]) -> str:
    """The table, the files to open as links, and the pictures shown; links are relative to run_dir (where
    summary.md lies), so they work wherever the run dir is viewed or copied."""

    def rel(path) -> str:
        return Path(path).relative_to(run_dir).as_posix()

    lines = [f"# eaglepipe run summary: {run_dir}", "", "| stage | time | key figure |", "|---|---:|---|"]
    lines += [f"| {s} | {t} | {f} |" for s, t, f in table]
    lines += ["", "Open next:", ""] + [f"- [{p}]({rel(p)})" for p in files]
    shown = pictures(run_dir)
    if shown:
        lines += ["", "## Pictures", ""]
        lines += [
            f"![{caption}]({rel(path)})\n\n{caption}: [{rel(path)}]({rel(path)})\n" for caption, path in shown
        ]
    return "\n".join(lines).rstrip("\n") + "\n"


def report(run_dir: Path, order: list[str], ran: set[str]) -> Path:
    """Print the summary table (rich) and write run_dir/summary.md; returns its path."""
    from rich.console import Console
    from rich.table import Table

    run_dir = Path(run_dir)
    table, files = rows(run_dir, order, ran), files_to_open(run_dir)
    path = RunDir(Path(run_dir)).summary_md
    path.write_text(markdown(run_dir, table, files))
    t = Table(title=f"eaglepipe: {run_dir}", show_lines=False)
    t.add_column("stage", style="bold")
    t.add_column("time", justify="right")
    t.add_column("key figure", overflow="fold")
    for row in table:
        t.add_row(*row)
    console = Console(width=max(Console().width, 120))
    console.print(t)
    console.print("open next:\n" + "\n".join(f"  {f}" for f in files + [str(path)]), soft_wrap=True)
    return path
