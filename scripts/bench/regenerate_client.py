"""How many requests regeneration's client keeps in flight (issue #31): prepare's EndpointClient over a local
OpenAI-compatible test server (the external boundary) that answers every request after a fixed delay, so the ideal
wall time is conversations / concurrency x delay and anything above it is the client's own.

On the H200 (2026-12-03) SGLang saw 1-10 running requests of the 512 asked for most of a 21,844-request
regeneration (7.7K tokens/s). Here, 5,000 conversations, 0.5 s per request, concurrency 512 (2-core dev machine,
the server in the same process): one httpx.Client shared by all threads kept 34 requests in flight on average
(71.1 s against an ideal 4.9 s); one client per thread, the fix, 128 (18.6 s), the rest being this machine's two
cores serving the test server too.
Usage: python scripts/bench/regenerate_client.py [--conversations 5000] [--delay 0.5] [--concurrency 512]
"""

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts" / "bench")]
import bench_json  # noqa: E402


def serve(delay: float, state: dict):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send({"object": "list", "data": []})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            with state["lock"]:
                state["inflight"] += 1
                state["peak"] = max(state["peak"], state["inflight"])
            time.sleep(delay)
            with state["lock"]:
                state["inflight"] -= 1
            self._send({"choices": [{"message": {"content": "word " * 200}}], "usage": {"completion_tokens": 200}})

    ThreadingHTTPServer.request_queue_size = 4096
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=5000)
    ap.add_argument("--delay", type=float, default=0.5)
    ap.add_argument("--concurrency", type=int, default=512)
    a = ap.parse_args()
    from pipeline.data import regenerate as regen
    from pipeline.data.journal import Journal

    state = {"lock": threading.Lock(), "inflight": 0, "peak": 0, "samples": []}
    srv = serve(a.delay, state)

    def sample():
        while True:
            state["samples"].append(state["inflight"])
            time.sleep(0.2)

    threading.Thread(target=sample, daemon=True).start()
    p = SimpleNamespace(endpoint_concurrency=a.concurrency, endpoint_timeout_s=600, endpoint_retries=4,
                        endpoint_backoff_s=1.0, max_new_tokens=256, temperature=0.0, on_failed_request="fail")
    convs = [{"source_id": f"c{i}", "messages": [{"role": "user", "content": f"question {i} " * 50},
                                                 {"role": "assistant", "content": "old"}]} for i in range(a.conversations)]
    client = regen.EndpointClient(p, f"http://127.0.0.1:{srv.server_address[1]}", "m", None)
    with Journal(pathlib.Path(tempfile.mkdtemp()), "bench") as journal:
        t0 = time.time()
        stats = regen._over_endpoint(SimpleNamespace(prepare=p, seed=0), client, convs, journal)
        wall = time.time() - t0
    ideal = a.conversations / a.concurrency * a.delay
    res = bench_json.header("regenerate_client", conversations=a.conversations, delay_s=a.delay,
                            concurrency=a.concurrency, wall_s=round(wall, 2), ideal_wall_s=round(ideal, 2),
                            peak_in_flight=state["peak"], mean_in_flight=round(statistics.mean(state["samples"]), 1),
                            tokens_per_s=stats["tokens_per_s"])
    print(json.dumps(res))
    bench_json.write(res, "regenerate_client_cpu", ROOT / "scripts" / "bench" / "results")


if __name__ == "__main__":
    main()
