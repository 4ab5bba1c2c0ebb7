"""formats/eval_plots.py: eval/tau.png with whole-number draft lengths and the 95 % intervals, eval/online.png
with tokens/s and speedup per concurrency (median, min-max over repeats); summary.md links and shows them.
Each picture is checked by its PNG size and by the axes drawn (captured just before saving)."""

import struct

import pytest

from pipeline.formats import eval_plots, eval_reports, summary


def png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def tau_report(ks=(1, 2, 3, 4, 5)) -> dict:
    def row(t, k):
        return {"tau": t, "tau_ci95": [t - 0.1 * k, t + 0.05 * k], "prompts": 16}

    return {
        "prompts": 16,
        "draft_lengths": list(ks),
        "trained": {str(k): row(1 + 0.2 * k / (1 + 0.3 * k), k) for k in ks},
        "untrained": {str(k): {"tau": 1.0, "tau_ci95": [1.0, 1.0], "prompts": 16} for k in ks},
    }


def online_report(baseline=True) -> dict:
    rows = {}
    for c, base in (("1", 100.0), ("8", 600.0), ("32", 1500.0)):
        spec = [base * 1.8, base * 1.7, base * 1.9]
        rows[c] = {"speculative": {"tokens_per_s": spec, "median": base * 1.8, "spread": 0.1}}
        if baseline:
            plain = [base, base * 0.98, base * 1.03]
            rows[c]["baseline"] = {"tokens_per_s": plain, "median": base, "spread": 0.05}
            rows[c]["speedup"] = [a / b for a, b in zip(spec, plain)]
            rows[c]["speedup_median"] = 1.8
    return {"bench": {"prompts": 16}, "by_concurrency": rows}


@pytest.fixture
def drawn(monkeypatch):
    """The figure each call drew, kept open for its axes to be read."""
    figures = []
    save = eval_plots._save

    def keep(fig, plt, path):
        figures.append(
            [(ax.get_xticks().tolist(), [t.get_text() for t in ax.get_xticklabels()], ax) for ax in fig.axes]
        )
        return save(fig, plt, path)

    monkeypatch.setattr(eval_plots, "_save", keep)
    return figures


def test_tau_png_has_whole_draft_lengths_and_the_intervals(tmp_path, drawn):
    path = eval_plots.tau(tau_report(), tmp_path / eval_reports.TAU_PNG)
    assert png_size(path) == (600, 400)
    ((ticks, labels, ax),) = drawn[0]
    assert ticks == [1, 2, 3, 4, 5] and labels == ["1", "2", "3", "4", "5"]  # not 1.25, 1.5, ...
    bars = [c for c in ax.containers if c.has_yerr]
    assert len(bars) == 2  # trained and untrained, each with its interval
    segments = bars[0].lines[2][0].get_segments()  # the trained draft's bars: [lo, hi] at each k
    report = tau_report()
    assert [tuple(s[:, 1].round(6)) for s in segments] == [
        tuple(round(v, 6) for v in report["trained"][str(k)]["tau_ci95"]) for k in range(1, 6)
    ]


def test_online_png_shows_tokens_per_s_and_speedup_per_concurrency(tmp_path, drawn):
    path = eval_plots.online(online_report(), tmp_path / eval_reports.ONLINE_PNG)
    assert png_size(path) == (1000, 400)
    (tps_ticks, tps_labels, tps), (_, sp_labels, sp) = drawn[0]
    assert tps_labels == ["1", "8", "32"] and sp_labels == ["1", "8", "32"] and tps_ticks == [0, 1, 2]
    assert [t.get_text() for t in tps.get_legend().get_texts()] == ["speculative", "baseline"]
    speedup_bars = [c for c in sp.containers if c.has_yerr][0]
    low_high = speedup_bars.lines[2][0].get_segments()[0][:, 1]
    ratios = online_report()["by_concurrency"]["1"]["speedup"]
    assert low_high.round(6).tolist() == [round(min(ratios), 6), round(max(ratios), 6)]


def test_online_png_without_a_baseline_shows_tokens_per_s_alone(tmp_path, drawn):
    path = eval_plots.online(online_report(baseline=False), tmp_path / "online.png")
    assert png_size(path) == (600, 400) and len(drawn[0]) == 1


def test_summary_md_links_and_shows_the_pictures_relative_to_the_run_dir(tmp_path):
    (tmp_path / "eval").mkdir()
    eval_plots.tau(tau_report(), tmp_path / "eval" / eval_reports.TAU_PNG)
    eval_plots.online(online_report(), tmp_path / "eval" / eval_reports.ONLINE_PNG)
    md = summary.markdown(tmp_path, [], summary.files_to_open(tmp_path))
    assert f"- [{tmp_path / 'eval' / 'tau.png'}](eval/tau.png)" in md
    assert f"- [{tmp_path / 'eval' / 'online.png'}](eval/online.png)" in md
    assert "![τ per draft length, 95 % intervals over prompts](eval/tau.png)" in md
    assert "![online: tokens/s and speedup per concurrency, spread over repeats](eval/online.png)" in md
