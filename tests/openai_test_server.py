"""TEST SERVER (the external boundary): a real OpenAI-compatible HTTP server on 127.0.0.1, deterministic.

It stands where SGLang or vLLM stand in production: GET /health and /v1/models, POST /v1/chat/completions (the
reply is a function of the whole message list, so a turn answered from a wrong prefix shows) and
/v1/completions (the text is a function of the seed: SYNTH_TEXTS[seed % len]). Behaviours for fault tests:
`die_after` (answer that many POSTs, then drop the connection and stop listening), `fail_first` (that many
500s first), `always` ("500" or "empty": every POST), `bad` ({substring: "500" | "empty"}: a POST whose last
message contains it), `no_usage` (no usage block: the client counts tokens itself).

In a thread: `server = start(**behaviour)`; `server.posts` lists every POST's body (every request it saw).
As a script (prepare.regenerate_server.engine=command): `python tests/openai_test_server.py --port P
[--requests-log FILE]`; it writes one line per POST to the log and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ThreadingHTTPServer.request_queue_size = (
    1024  # eaglepipe sends hundreds of requests at once (prepare.endpoint_concurrency)
)

SYNTH_TEXTS = [
    "What is the best way to learn to play the guitar as an adult?",
    "I'm sorry, but I cannot help with that request.",  # an assistant's refusal: dropped
    "Explain how a rainbow forms after the rain.",
    "What is the best way to learn to play the guitar as an adult?",  # a duplicate: dropped
    "hi",  # too short: dropped
    "Can you write a short poem about the sea and the wind?",
]


def chat_reply(messages: list[dict]) -> str:
    h = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:8]
    return f"reply {h} to: {messages[-1]['content'][:20]}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, code: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            return self._send(200, {})
        if self.path == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": "test", "object": "model"}]})
        self._send(404, {"error": "not found"})

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            n = len(srv.posts)
            if srv.die_after is not None and srv.answered >= srv.die_after:
                self.close_connection = True  # no answer: "server disconnected", then connections refused
                threading.Thread(target=lambda: (srv.shutdown(), srv.server_close()), daemon=True).start()
                return
            srv.posts.append(body)
            if srv.log:
                with open(srv.log, "a") as f:
                    f.write(json.dumps(body) + "\n")
        last = body["messages"][-1]["content"] if "messages" in body else body.get("prompt", "")
        how = srv.always or next((v for k, v in srv.bad.items() if k in last), None)
        if how == "500" or n < srv.fail_first:
            return self._send(500, {"error": "overloaded"})
        if self.path == "/v1/chat/completions":
            text = "" if how == "empty" else chat_reply(body["messages"])
            out = {
                "object": "chat.completion",
                "choices": [{"message": {"role": "assistant", "content": text}}],
            }
        elif self.path == "/v1/completions":
            text = "" if how == "empty" else SYNTH_TEXTS[body.get("seed", 0) % len(SYNTH_TEXTS)]
            out = {"object": "text_completion", "choices": [{"text": text}]}
        else:
            return self._send(404, {"error": "not found"})
        if not srv.no_usage:
            out["usage"] = {"completion_tokens": len(text.split())}
        with srv.lock:
            srv.answered += 1
        self._send(200, out)

    def log_message(self, *args):
        pass


def start(
    port: int = 0, die_after=None, fail_first: int = 0, always=None, bad=None, no_usage=False, log=None
):
    srv = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    srv.daemon_threads = True
    srv.lock, srv.posts, srv.answered = threading.Lock(), [], 0
    srv.die_after, srv.fail_first, srv.always, srv.no_usage, srv.log = (
        die_after,
        fail_first,
        always,
        no_usage,
        log,
    )
    srv.bad = bad or {}
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.url = f"http://127.0.0.1:{srv.server_port}"
    return srv


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--requests-log")
    args = ap.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.lock, server.posts, server.answered = threading.Lock(), [], 0
    server.die_after, server.fail_first, server.always, server.no_usage, server.bad = None, 0, None, False, {}
    server.log = args.requests_log
    print(f"test server pid {os.getpid()} listening on {args.port}", flush=True)
    server.serve_forever()
