"""An SGLang-LIKE TEST SERVER (the true external boundary: no engine serves on this CPU machine), whose speed
depends on the speculative settings it is launched with. Run as a script with SGLang's own launch flags, as
`eaglepipe tune-serve` starts SGLang (tune.launch_prefix="python tests/sglang_like_server.py --behaviour F"),
or in a thread (`handler(...)`) for the bench's own tests.

It answers what the online bench and the sweep read, with the fields of SGLang's sources: GET /health,
GET /get_server_info (model_path, speculative_* settings, attention_backend, cuda_graph_max_bs), POST
/generate (meta_info.completion_tokens, spec_verify_ct). The behaviour file maps "plain" (no
--speculative-algorithm) or a candidate's num_steps (as a string) to {"delay_s": seconds per request,
"fail_at_start": true, "die_after": N requests then the process exits, "reports": {server_info fields that
differ from the flags}}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def handler(
    info: dict,
    delay_s: float = 0.0,
    accept_length: float = 2.5,
    die_after: int | None = None,
    exit_on_death: bool = False,
    generate_raw: bytes | None = None,
    info_raw: bytes | None = None,
):
    """A request handler class: /get_server_info answers `info`; each /generate sleeps delay_s and generates
    max_new_tokens (verify passes at accept_length when info says it speculates); after die_after requests the
    server stops answering (the process exits when exit_on_death, else each connection closes unanswered).
    A broken server: `generate_raw` is every POST's answer (HTTP 200, these bytes), `info_raw` that of
    /server_info and /get_server_info."""
    state = {"served": 0, "lock": threading.Lock()}

    class SGLangLikeTestServer(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code, body):
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _dead(self) -> bool:
            if die_after is not None and state["served"] >= die_after:
                if exit_on_death:
                    os._exit(3)
                self.close_connection = True
                return True
            return False

        def do_GET(self):
            if self._dead():
                return
            if self.path == "/health":
                return self._send(200, {})
            if info_raw is not None and self.path in ("/server_info", "/get_server_info"):
                return self._send(200, info_raw)
            if self.path == "/get_server_info":
                return self._send(200, info)
            self._send(404, {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if generate_raw is not None:
                return self._send(200, generate_raw)
            with state["lock"]:
                if self._dead():
                    return
                state["served"] += 1
            n = body["sampling_params"]["max_new_tokens"]
            time.sleep(delay_s)
            verify = -(-n * 2 // int(accept_length * 2)) if info.get("speculative_algorithm") else 0
            self._send(200, {"text": "x", "meta_info": {"completion_tokens": n, "spec_verify_ct": verify}})

    return SGLangLikeTestServer


def info_of(args) -> dict:
    spec = args.speculative_algorithm
    return {
        "version": "sglang-like-test-server",
        "model_path": args.model_path,
        "speculative_algorithm": spec,
        "speculative_draft_model_path": args.speculative_draft_model_path,
        "speculative_num_steps": args.speculative_num_steps if spec else None,
        "speculative_eagle_topk": args.speculative_eagle_topk if spec else None,
        "speculative_num_draft_tokens": args.speculative_num_draft_tokens if spec else None,
        "attention_backend": args.attention_backend,
        "cuda_graph_max_bs": args.cuda_graph_max_bs,
        "disable_cuda_graph": False,
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--behaviour", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model-path", required=True)
    p.add_argument("--speculative-algorithm")
    p.add_argument("--speculative-draft-model-path")
    p.add_argument("--speculative-num-steps", type=int)
    p.add_argument("--speculative-eagle-topk", type=int)
    p.add_argument("--speculative-num-draft-tokens", type=int)
    p.add_argument("--attention-backend")
    p.add_argument("--cuda-graph-max-bs", type=int)
    args, _ = p.parse_known_args(argv)  # --dtype, --mem-fraction-static, ...: SGLang's, not read here
    with open(args.behaviour) as f:
        behaviour = json.load(f)
    key = str(args.speculative_num_steps) if args.speculative_algorithm else "plain"
    b = behaviour.get(key, {})
    print(f"sglang-like test server: {key} {b}", flush=True)
    if b.get("fail_at_start"):
        print(
            "RuntimeError: not enough memory for the KV cache (test server told to fail at start)", flush=True
        )
        sys.exit(1)
    info = {**info_of(args), **b.get("reports", {})}
    server = ThreadingHTTPServer(
        (args.host, args.port),
        handler(info, b.get("delay_s", 0.0), die_after=b.get("die_after"), exit_on_death=True),
    )
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
