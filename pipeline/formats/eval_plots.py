"""evaluate's two pictures, drawn from its reports (formats/eval_reports.py names both): eval/tau.png, τ per
draft length with its 95 % interval over prompts (acceptance.json's tau_ci95), and eval/online.png, the
online bench's tokens/s and speedup per concurrency, each a median with the spread of its repeats
(online.json's by_concurrency). Draft lengths and concurrencies are whole numbers, so they are the only
ticks. Pure: matplotlib (Agg) only, no device."""

from __future__ import annotations

from pathlib import Path

COLORS = {"trained": "tab:blue", "untrained": "tab:gray", "speculative": "tab:blue", "baseline": "tab:orange"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def tau(report: dict, path: Path) -> Path:
    """τ of the trained and the untrained draft per draft length k, error bars = the 95 % interval."""
    plt = _pyplot()
    ks = [int(k) for k in report["draft_lengths"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("trained", "untrained"):
        rows = [report[name][str(k)] for k in ks]
        taus = [r["tau"] for r in rows]
        cis = [r.get("tau_ci95") or [r["tau"], r["tau"]] for r in rows]
        below = [max(t - lo, 0.0) for t, (lo, _) in zip(taus, cis)]
        above = [max(hi - t, 0.0) for t, (_, hi) in zip(taus, cis)]
        label = f"{name} draft"
        ax.errorbar(ks, taus, yerr=[below, above], fmt="o-", capsize=4, color=COLORS[name], label=label)
    ax.set_xticks(ks)
    ax.set_xlim(ks[0] - 0.5, ks[-1] + 0.5)
    ax.set_xlabel("draft length k (tokens proposed per round)")
    ax.set_ylabel("τ (tokens per target forward)")
    title = f"accepted tokens, {report['prompts']} prompts; bars: 95 % interval over prompts"
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, plt, path)


def online(report: dict, path: Path) -> Path:
    """Per concurrency: each server's tokens/s and the speedup, a point at the median and a bar over the
    repeats (min to max); without a baseline server, tokens/s alone."""
    plt = _pyplot()
    rows = report.get("by_concurrency") or {}
    cs = sorted(rows, key=int)
    has_speedup = any("speedup" in rows[c] for c in cs)
    fig, axes = plt.subplots(1, 2 if has_speedup else 1, figsize=(10 if has_speedup else 6, 4), squeeze=False)
    x = list(range(len(cs)))  # one slot per concurrency asked (1, 8, 32 are not evenly spaced)
    ax = axes[0][0]
    for side in ("speculative", "baseline"):
        got = [(i, rows[c][side]) for i, c in zip(x, cs) if side in rows[c]]
        if got:
            xs, values = [i for i, _ in got], [r["tokens_per_s"] for _, r in got]
            _median_and_range(ax, xs, values, COLORS[side], side)
    _axis(ax, x, cs, "tokens / s (all requests together)")
    prompts = (report.get("bench") or {}).get("prompts", "?")
    ax.set_title(f"{prompts} prompts x repeats; points: median, bars: min-max", fontsize=9)
    if has_speedup:
        ax = axes[0][1]
        got = [(i, rows[c]["speedup"]) for i, c in zip(x, cs) if "speedup" in rows[c]]
        _median_and_range(ax, [i for i, _ in got], [s for _, s in got], "tab:green", "speculative / baseline")
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        _axis(ax, x, cs, "speedup (paired passes)")
    return _save(fig, plt, path)


def _median_and_range(ax, x: list[int], values: list[list[float]], color: str, label: str) -> None:
    import statistics

    med = [statistics.median(v) for v in values]
    err = [[m - min(v) for m, v in zip(med, values)], [max(v) - m for m, v in zip(med, values)]]
    ax.errorbar(x, med, yerr=err, fmt="o-", capsize=4, color=color, label=label)


def _axis(ax, x: list[int], cs: list[str], ylabel: str) -> None:
    ax.set_xticks(x, cs)
    ax.set_xlim(-0.5, len(x) - 0.5)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
