"""The online bench client against local HTTP test servers that speak SGLang's and vLLM's protocols.

SGLangLikeTestServer and VLLMLikeTestServer are TEST SERVERS (a true external boundary: no engine can serve
on this CPU machine). They answer over real HTTP with the fields the engines' sources define: SGLang's
/generate meta_info (completion_tokens, spec_verify_ct), vLLM's /v1/completions usage and its Prometheus
spec-decode counters at /metrics. The numbers they return are fixed so the expected report is known.
"""

import json
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pipeline.errors import UserError
from pipeline.runner import run_stages

pytestmark = pytest.mark.slow


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, code, body, ctype="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _json(self):
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))


class SGLangLikeTestServer(_Handler):
    """/generate: every request generates max_new_tokens in ceil(n / 2.5) verify passes (accept length
    2.5)."""

    def do_GET(self):
        info = {"version": "test-server", "speculative_algorithm": "EAGLE3", "model_path": "the-target"}
        self._send(200, info) if self.path == "/get_server_info" else self._send(404, {})

    def do_POST(self):
        body = self._json()
        assert self.path == "/generate" and isinstance(body["input_ids"], list)
        n = body["sampling_params"]["max_new_tokens"]
        self._send(
            200, {"text": "x", "meta_info": {"completion_tokens": n, "spec_verify_ct": -(-n * 2 // 5)}}
        )


def vllm_like(speculates: bool):
    counters = {
        "drafts": 100.0,
        "draft_tokens": 300.0,
        "accepted": 150.0,
        "pos": [60.0, 50.0, 40.0],
    }  # not zero at start
    lock = threading.Lock()

    class VLLMLikeTestServer(_Handler):
        """Per request: 4 drafts of 3 tokens, 6 accepted (3/2/1 at positions 0/1/2): accept length 2.5."""

        def do_GET(self):
            if self.path == "/v1/models":
                return self._send(200, {"data": [{"id": "the-target"}]})
            if self.path != "/metrics":
                return self._send(404, {})
            c = counters
            text = (
                (
                    "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.\n"
                    f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {c["drafts"]}\n'
                    'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} '
                    f"{c['draft_tokens']}\n"
                    'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} '
                    f"{c['accepted']}\n"
                    + "".join(
                        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{i}"}} '
                        f"{v}\n"
                        for i, v in enumerate(c["pos"])
                    )
                    + "vllm:num_requests_running 0.0\n"
                )
                if speculates
                else "vllm:num_requests_running 0.0\n"
            )
            self._send(200, text.encode(), "text/plain")

        def do_POST(self):
            body = self._json()
            assert (
                self.path == "/v1/completions"
                and body["model"] == "the-target"
                and body["temperature"] == 0.0
            )
            with lock:
                counters["drafts"] += 4
                counters["draft_tokens"] += 12
                counters["accepted"] += 6
                for i, a in enumerate((3, 2, 1)):
                    counters["pos"][i] += a
            self._send(200, {"choices": [{"text": "x"}], "usage": {"completion_tokens": body["max_tokens"]}})

    return VLLMLikeTestServer


@pytest.fixture
def serve():
    servers = []

    def start(handler):
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()


@pytest.fixture(scope="module")
def run_copy(exported_run, tmp_path_factory):
    """This module's copy of the session's exported run: its evaluate writes eval/ and a stage record, which
    the run other files read (and check tools leave alone) must not get."""
    run_dir = tmp_path_factory.mktemp("online") / "run"
    shutil.copytree(exported_run[0], run_dir)
    return run_dir


def _online(make_cfg, run_dir, *overrides):
    run_stages(
        make_cfg(
            "+experiment=tiny",
            "data.limit=16",
            "stage=evaluate",
            "eval.max_new_tokens=10",
            "eval.repeats=1",
            "eval.warmup_prompts=0",
            *overrides,
            run_dir=run_dir,
        )
    )
    return json.loads((run_dir / "eval" / "online.json").read_text())


def test_sglang_endpoint_accept_length_and_speedup_over_a_baseline(run_copy, make_cfg, serve, tmp_path):
    run_dir = run_copy
    report = _online(
        make_cfg,
        run_dir,
        f"eval.endpoint={serve(SGLangLikeTestServer)}",
        f"eval.baseline_endpoint={serve(vllm_like(speculates=False))}",
    )
    spec, base = report["speculative"], report["baseline"]
    n = spec["requests"]  # the held-out prompts of the run (one pass: eval.repeats=1, no warm-up)
    assert spec["engine"] == "sglang" and n >= 2 and spec["completion_tokens"] == 10 * n
    assert spec["verify_passes"] == 4 * n and spec["accept_length"] == pytest.approx(2.5)
    assert base["engine"] == "vllm" and base["accept_length"] is None and base["drafts"] == 0
    assert report["speedup"] == pytest.approx(spec["tokens_per_s"] / base["tokens_per_s"])


def sglang_like(disable_cuda_graph: bool, speculates: bool, delay_s: float):
    class SGLangLikeTestServerWithFacts(_Handler):
        """/get_server_info with the settings SGLang reports; /generate after delay_s, speculating at accept
        length 2.5 or not at all."""

        def do_GET(self):
            if self.path != "/get_server_info":
                return self._send(404, {})
            self._send(
                200,
                {
                    "version": "test-server",
                    "disable_cuda_graph": disable_cuda_graph,
                    "speculative_algorithm": "EAGLE3" if speculates else None,
                    "attention_backend": "triton",
                },
            )

        def do_POST(self):
            n = self._json()["sampling_params"]["max_new_tokens"]
            time.sleep(delay_s)
            self._send(
                200,
                {
                    "text": "x",
                    "meta_info": {
                        "completion_tokens": n,
                        "spec_verify_ct": -(-n * 2 // 5) if speculates else 0,
                    },
                },
            )

    return SGLangLikeTestServerWithFacts


def test_a_slower_speculative_server_is_said_with_the_settings_that_explain_it(
    run_copy, make_cfg, serve, caplog
):
    """On the H200 a speculative server without CUDA graphs ran at 0.13x of a plain one with them: the report
    records each server's own settings and says, in one line, why the speedup is below 1."""
    run_dir = run_copy
    report = _online(
        make_cfg,
        run_dir,
        f"eval.endpoint={serve(sglang_like(True, True, 0.3))}",
        f"eval.baseline_endpoint={serve(sglang_like(False, False, 0.0))}",
    )
    assert report["speculative"]["server"]["disable_cuda_graph"] is True
    assert report["speculative"]["server"]["speculative_algorithm"] == "EAGLE3"
    assert (
        report["baseline"]["server"]["disable_cuda_graph"] is False
        and report["baseline"]["accept_length"] is None
    )
    assert report["speedup"] < 1
    assert "not like for like" in report["speedup_note"] and "accept length 2.50" in report["speedup_note"]
    assert any("slower than the baseline" in r.getMessage() for r in caplog.records)
    both_off = _online(
        make_cfg,
        run_dir,
        f"eval.endpoint={serve(sglang_like(True, True, 0.3))}",
        f"eval.baseline_endpoint={serve(sglang_like(True, False, 0.0))}",
    )
    assert "neither server runs CUDA graphs" in both_off["speedup_note"]
    faster = _online(
        make_cfg,
        run_dir,
        f"eval.endpoint={serve(sglang_like(True, True, 0.0))}",
        f"eval.baseline_endpoint={serve(sglang_like(True, False, 0.3))}",
    )
    assert faster["speedup"] > 1 and "speedup_note" not in faster


def test_vllm_endpoint_reads_the_counter_deltas(run_copy, make_cfg, serve):
    run_dir = run_copy
    spec = _online(
        make_cfg, run_dir, f"eval.endpoint={serve(vllm_like(speculates=True))}", "eval.concurrency=[2]"
    )["speculative"]
    assert (
        spec["engine"] == "vllm"
        and spec["drafts"] == 4 * spec["requests"]
        and spec["accepted"] == 6 * spec["requests"]
    )
    assert spec["accept_length"] == pytest.approx(2.5)
    assert spec["accept_per_position"] == pytest.approx([0.75, 0.5, 0.25])


def test_unreachable_endpoint_is_one_clear_error(run_copy, make_cfg):
    run_dir = run_copy
    with pytest.raises(UserError, match="is the server running"):
        _online(make_cfg, run_dir, "eval.endpoint=http://127.0.0.1:9")


def test_a_dead_baseline_is_one_line_naming_it_and_no_speedup(run_copy, make_cfg, serve):
    """The two servers' passes are interleaved, so a baseline that is not there is found before any is
    measured
    (issue #36: no speedup from a run that is not like for like)."""
    run_dir = run_copy
    (run_dir / "eval" / "online.json").unlink(missing_ok=True)
    with pytest.raises(UserError, match="the baseline server: .*is the server running.*nothing was measured"):
        _online(
            make_cfg,
            run_dir,
            f"eval.endpoint={serve(SGLangLikeTestServer)}",
            "eval.baseline_endpoint=http://127.0.0.1:9",
        )
    report = json.loads((run_dir / "eval" / "online.json").read_text())
    assert report["failed_side"] == "baseline" and "speedup" not in report


def test_online_accept_length_per_prompt_set_in_one_table(run_copy, make_cfg, serve):
    """eval.endpoint with eval.sets: one online.json per set and one table (eval/sets_online.json) of the
    server's accept length and speedup per set, the offline table (eval/sets.json) left as it was;
    mt_bench_turn2's first
    answers come from the server itself."""
    run_dir = run_copy
    offline_table = run_dir / "eval" / "sets.json"
    offline_table.parent.mkdir(parents=True, exist_ok=True)
    offline_table.write_text('{"heldout": {"prompts": 2, "tau": {"1": 1.5}}}')
    url, base = serve(SGLangLikeTestServer), serve(vllm_like(speculates=False))
    run_stages(
        make_cfg(
            "+experiment=tiny",
            "data.limit=16",
            "stage=evaluate",
            "eval.max_new_tokens=10",
            "eval.num_prompts=2",
            "eval.sets=[heldout,mt_bench,mt_bench_turn2,humaneval]",
            f"eval.endpoint={url}",
            f"eval.baseline_endpoint={base}",
            run_dir=run_dir,
        )
    )
    table = json.loads((run_dir / "eval" / "sets_online.json").read_text())
    assert list(table) == ["heldout", "mt_bench", "mt_bench_turn2", "humaneval"]
    assert json.loads(offline_table.read_text()) == {"heldout": {"prompts": 2, "tau": {"1": 1.5}}}
    for name, row in table.items():
        per_set = json.loads(
            (run_dir / "eval" / ("" if name == "heldout" else name) / "online.json").read_text()
        )
        assert row["prompts"] == 2 and row["accept_length"] == pytest.approx(2.5), name
        assert row["speedup"] == pytest.approx(per_set["speedup"]) and row["speedup"] > 0, name
