"""The online bench's reading of a vLLM server's Prometheus counters (pipeline/serving/bench.py), on text
in
vLLM 0.33's /metrics format, and the accept length it makes of their before/after difference."""

import pytest

from pipeline.errors import UserError
from pipeline.serving import bench as online_bench
from pipeline.serving import endpoint

HEAD = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
"""


def metrics(drafts, draft_tokens, accepted, per_pos, engines=("0",)):
    """/metrics text: every counter once per engine (label set), the values split evenly between them."""
    n = len(engines)
    lines = [
        HEAD.rstrip("\n"),
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:generation_tokens_total{engine="0",model_name="m"} 9999.0',
    ]
    for e in engines:
        labels = f'engine="{e}",model_name="m"'
        lines += [
            f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts / n}",
            f"vllm:spec_decode_num_drafts_created{{{labels}}} 1.7648e+09",  # a timestamp, not a count
            f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {draft_tokens / n}",
            f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {accepted / n}",
        ]
        lines += [
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {v / n}'
            for i, v in enumerate(per_pos)
        ]
    return "\n".join(lines) + "\n"


class Response:
    def __init__(self, status_code=200, text="", body=None):
        self.status_code, self.text, self._body = status_code, text, body

    def json(self):
        return self._body


class Client:
    """A vLLM server: /metrics answers pages[0] until the first completion, then pages[-1]; each completion
    gives 10 tokens."""

    def __init__(self, pages):
        self.pages, self.posts = list(pages), 0

    def get(self, url):
        if url.endswith("/get_server_info"):
            return Response(404)
        if url.endswith("/v1/models"):
            return Response(body={"data": [{"id": "m"}]})
        if url.endswith("/version"):  # vLLM's own account of itself
            return Response(body={"version": "0.33.0"})
        if url.endswith("/metrics"):
            return Response(text=self.pages[-1] if self.posts else self.pages[0])
        raise AssertionError(url)

    def post(self, url, json):
        self.posts += 1
        assert url.endswith("/v1/completions") and json["temperature"] == 0.0
        return Response(body={"choices": [{"text": "x"}], "usage": {"completion_tokens": 10}})


def test_each_counter_is_read_with_or_without_the_total_suffix():
    text = metrics(40, 120, 66, [30, 22, 14]).replace("num_draft_tokens_total", "num_draft_tokens")
    got = endpoint.vllm_counters(Client([text]), "http://x")
    assert got == {
        "num_drafts": 40.0,
        "num_draft_tokens": 120.0,
        "num_accepted_tokens": 66.0,
        "per_pos": {0: 30.0, 1: 22.0, 2: 14.0},
    }


def test_counters_are_summed_over_engines_and_other_metrics_ignored():
    got = endpoint.vllm_counters(Client([metrics(40, 120, 66, [30, 22, 14], engines=("0", "1"))]), "http://x")
    assert got == {
        "num_drafts": 40.0,
        "num_draft_tokens": 120.0,
        "num_accepted_tokens": 66.0,
        "per_pos": {0: 30.0, 1: 22.0, 2: 14.0},
    }


def test_a_server_without_speculation_has_no_counters():
    assert endpoint.vllm_counters(Client([HEAD + 'vllm:num_requests_running{engine="0"} 0.0\n']), "u") == {
        "per_pos": {}
    }


def test_scientific_notation_values_are_read():
    text = 'vllm:spec_decode_num_drafts_total{engine="0"} 1.5e+03\n'
    assert endpoint.vllm_counters(Client([text]), "u")["num_drafts"] == 1500.0


def test_accept_length_comes_from_the_counters_difference_over_the_bench(monkeypatch):
    before = metrics(100, 300, 50, [30, 15, 5])  # counted before the bench started: not ours
    after = metrics(140, 420, 116, [60, 37, 19])  # +40 drafts, +66 accepted, per position +30 +22 +14
    client = Client([before, after])
    monkeypatch.setattr("httpx.Client", lambda **kw: Ctx(client))
    report = online_bench.firm_bench(
        "http://x/", None, [[1, 2], [3], [4, 5, 6]], 10, [2], repeats=1, warmup=0, timeout_s=5
    )["speculative"]
    assert client.posts == 3
    assert (report["engine"], report["endpoint"], report["requests"], report["completion_tokens"]) == (
        "vllm",
        "http://x",
        3,
        30,
    )
    assert report["server"] == {"version": "0.33.0"}
    assert (report["drafts"], report["draft_tokens"], report["accepted"]) == (40.0, 120.0, 66.0)
    assert report["accept_length"] == pytest.approx(1 + 66 / 40)
    assert report["accept_per_position"] == pytest.approx([30 / 40, 22 / 40, 14 / 40])


def test_no_new_drafts_means_no_accept_length(monkeypatch):
    page = metrics(100, 300, 50, [30, 15, 5])
    monkeypatch.setattr("httpx.Client", lambda **kw: Ctx(Client([page, page])))
    report = online_bench.firm_bench("http://x", None, [[1]], 4, [1], repeats=1, warmup=0, timeout_s=5)[
        "speculative"
    ]
    assert report["drafts"] == 0.0 and report["accept_length"] is None


def test_a_server_of_neither_engine_is_one_clear_error():
    class Nothing:
        def get(self, url):
            return Response(404)

    with pytest.raises(UserError, match="answers neither SGLang's /get_server_info nor vLLM's /metrics"):
        endpoint.detect_engine(Nothing(), "http://x")


class Ctx:
    def __init__(self, client):
        self.client = client

    def __enter__(self):
        return self.client

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):  # used without `with` too (the bench's per-thread clients)
        return getattr(self.client, name)

    def close(self):
        pass


def test_first_answers_for_a_second_turn_come_from_the_server_in_prompt_order(monkeypatch):
    """eval.endpoint with mt_bench_turn2: the served target's greedy answer to each first turn, in prompt
    order,
    from vLLM's completion text and SGLang's /generate text."""
    from types import SimpleNamespace

    class Server(Client):
        def __init__(self, engine):
            super().__init__([metrics(0, 0, 0, [])])
            self.engine = engine

        def get(self, url):
            if url.endswith("/get_server_info"):
                return Response(200 if self.engine == "sglang" else 404)
            return super().get(url)

        def post(self, url, json):
            assert json.get("temperature", json.get("sampling_params", {}).get("temperature")) == 0.0
            if self.engine == "sglang":
                assert url.endswith("/generate")
                return Response(
                    body={"text": f" answer {json['input_ids'][0]} ", "meta_info": {"completion_tokens": 3}}
                )
            limit = json["max_tokens"]
            return Response(
                body={
                    "usage": {"completion_tokens": limit},
                    "choices": [{"text": f"answer {json['prompt'][0]}"}],
                }
            )

    cfg = SimpleNamespace(
        eval=SimpleNamespace(endpoint="http://x/", endpoint_timeout_s=5, concurrency=[1, 3])
    )
    for engine in ("sglang", "vllm"):
        monkeypatch.setattr("httpx.Client", lambda timeout, s=Server(engine): Ctx(s))
        got = online_bench.greedy_answers(cfg, None, [[7, 1], [3], [9, 2, 2]], 16)
        assert got == ["answer 7", "answer 3", "answer 9"], engine
