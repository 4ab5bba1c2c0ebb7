"""The firm online bench (pipeline/serving/bench.py firm_bench) against SGLang-like test servers in
threads (tests/sglang_like_server.py: the true external boundary): warm-up excluded, repeats interleaved
between the two
servers, median and spread per concurrency, and the refusals of what is not like for like."""

import json
import statistics
import struct
import threading
from http.server import ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from sglang_like_server import handler

from pipeline.errors import UserError
from pipeline.serving import bench as online
from pipeline.serving import endpoint

SPEC = {"model_path": "/models/t", "speculative_algorithm": "EAGLE3", "speculative_num_steps": 3}
PLAIN = {"model_path": "/models/t", "speculative_algorithm": None}
PROMPTS = [[1, 2], [3], [4, 5, 6]]


@pytest.fixture
def serve():
    servers = []

    def start(info, delay_s=0.0, die_after=None, log=None, name=None):
        cls = handler(info, delay_s, die_after=die_after)
        if log is not None:  # every /generate, in arrival order across servers
            post = cls.do_POST

            def do_POST(self):
                log.append(name)
                post(self)

            cls.do_POST = do_POST
        server = ThreadingHTTPServer(("127.0.0.1", 0), cls)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()


def test_spread_is_max_minus_min_over_the_median():
    assert online.spread([10.0, 12.0, 11.0]) == {"median": 11.0, "spread": pytest.approx(2 / 11)}
    assert online.spread([5.0]) == {"median": 5.0, "spread": 0.0}


def test_warm_up_is_not_counted_and_the_repeats_alternate_between_the_servers(serve):
    arrivals = []
    spec = serve(SPEC, 0.001, log=arrivals, name="s")
    base = serve(PLAIN, 0.002, log=arrivals, name="b")
    report = online.firm_bench(spec, base, PROMPTS, 8, [1, 2], repeats=3, warmup=2, timeout_s=10)
    runs = [arrivals[0]]  # the arrival order as runs of one server's requests
    for a, b in zip(arrivals, arrivals[1:]):
        if a != b:
            runs.append(b)
    assert (
        runs == ["s", "b"] + ["s", "b"] * 6
    )  # warm-up of each, then 2 concurrencies x 3 repeats, A B A B A B
    assert len(arrivals) == 2 * (2 + 2 * 3 * len(PROMPTS))
    assert report["speculative"]["passes"] == 6 and report["speculative"]["completion_tokens"] == 6 * 3 * 8
    assert report["speculative"]["accept_length"] == pytest.approx(8 / 4)  # ceil(8 / 2.5) = 4 verify passes


def test_each_concurrency_has_every_repeat_median_spread_and_the_paired_speedup(serve):
    report = online.firm_bench(
        serve(SPEC, 0.002), serve(PLAIN, 0.05), PROMPTS, 8, [1, 2], repeats=3, warmup=0, timeout_s=10
    )
    assert list(report["by_concurrency"]) == ["1", "2"]
    for row in report["by_concurrency"].values():
        spec, base = row["speculative"]["tokens_per_s"], row["baseline"]["tokens_per_s"]
        assert len(spec) == len(base) == 3
        assert row["speculative"]["median"] == statistics.median(spec)
        assert row["speculative"]["spread"] == pytest.approx(
            (max(spec) - min(spec)) / statistics.median(spec)
        )
        ratios = [a / b for a, b in zip(spec, base)]
        assert row["speedup"] == pytest.approx(ratios)
        assert row["speedup_median"] == pytest.approx(statistics.median(ratios))
        assert row["speedup_spread"] == pytest.approx((max(ratios) - min(ratios)) / statistics.median(ratios))
    assert report["speedup"] == report["by_concurrency"]["1"]["speedup_median"] > 1
    assert report["speculative"]["server"]["speculative_algorithm"] == "EAGLE3"
    assert report["baseline"]["server"]["speculative_algorithm"] is None


@pytest.mark.parametrize(
    "spec_info,base_info,says",
    [
        (PLAIN, PLAIN, "serves without speculative settings.*serve.sh"),
        (SPEC, SPEC, "baseline_endpoint .* is itself speculative.*without the --speculative"),
        (
            SPEC,
            {**PLAIN, "model_path": "/models/other"},
            "different targets.*/models/t.*/models/other.*--model-path",
        ),
    ],
)
def test_what_is_not_like_for_like_is_refused_before_any_request(serve, spec_info, base_info, says):
    arrivals = []
    spec, base = serve(spec_info, log=arrivals, name="s"), serve(base_info, log=arrivals, name="b")
    with pytest.raises(endpoint.NotLikeForLike, match=says) as e:
        online.firm_bench(spec, base, PROMPTS, 8, [1], repeats=3, warmup=2, timeout_s=10)
    assert arrivals == [] and "\n" not in str(e.value)


def test_a_server_that_dies_mid_bench_is_named_with_what_was_measured_and_no_speedup(serve, tmp_path):
    spec = serve(SPEC, die_after=len(PROMPTS) * 3 + 1)  # dies in its fourth pass: concurrency 2, repeat 1
    base = serve(PLAIN)
    cfg = SimpleNamespace(
        eval=SimpleNamespace(
            endpoint=spec,
            baseline_endpoint=base,
            max_new_tokens=8,
            concurrency=[1, 2],
            repeats=3,
            warmup_prompts=0,
            endpoint_timeout_s=10,
        )
    )
    with pytest.raises(
        UserError,
        match=rf"the speculative server {spec} stopped answering at concurrency 2, "
        r"repeat 1 of 3.*measured before it.*no speedup",
    ) as e:
        online.measure(cfg, None, PROMPTS, tmp_path)
    assert "\n" not in str(e.value)
    report = json.loads((tmp_path / "online.json").read_text())
    assert report["failed_side"] == "speculative"
    assert len(report["by_concurrency"]["1"]["speculative"]["tokens_per_s"]) == 3
    assert len(report["by_concurrency"]["1"]["baseline"]["tokens_per_s"]) == 3
    assert "speedup" not in report and not any("speedup" in row for row in report["by_concurrency"].values())
    assert png_size(tmp_path / "online.png") == (600, 400)  # what was measured, drawn: tokens/s, no speedup


def test_an_unreachable_baseline_is_one_line_and_nothing_is_measured(serve, tmp_path):
    cfg = SimpleNamespace(
        eval=SimpleNamespace(
            endpoint=serve(SPEC),
            baseline_endpoint="http://127.0.0.1:9",
            max_new_tokens=8,
            concurrency=[1],
            repeats=1,
            warmup_prompts=0,
            endpoint_timeout_s=5,
        )
    )
    with pytest.raises(UserError, match="the baseline server: .*is the server running.*nothing was measured"):
        online.measure(cfg, None, PROMPTS, tmp_path)
    assert "speedup" not in json.loads((tmp_path / "online.json").read_text())
    assert not (tmp_path / "online.png").exists()  # nothing measured, nothing drawn


def png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_a_finished_bench_draws_online_png_beside_online_json(serve, tmp_path):
    """#50: tokens/s and the speedup per concurrency as a picture (eval_plots.online), not JSON only."""
    cfg = SimpleNamespace(
        eval=SimpleNamespace(
            endpoint=serve(SPEC),
            baseline_endpoint=serve(PLAIN),
            max_new_tokens=8,
            concurrency=[1, 2],
            repeats=2,
            warmup_prompts=0,
            endpoint_timeout_s=10,
        )
    )
    online.measure(cfg, None, PROMPTS, tmp_path)
    assert "speedup" in json.loads((tmp_path / "online.json").read_text())
    assert png_size(tmp_path / "online.png") == (1000, 400)  # two panels: tokens/s, speedup
