"""Loss masks on the real chat templates: the supervised tokens decode to exactly the assistant turns."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from pipeline.data.chat_tokens import tokenize_with_mask
from pipeline.data.mixture import load_conversations
from pipeline.formats.prepared import load as load_prepared
from pipeline.models import targets
from pipeline.stages import prepare

pytestmark = pytest.mark.slow

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there, who are you?"},
    {"role": "assistant", "content": "I am a small model. Nice to meet you!"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4, of course."},
]


def supervised_runs(tok, ids, mask):
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


@pytest.mark.parametrize("which", ["smol_folder", "tiny_folder"])
def test_loss_mask_is_exactly_assistant_content_plus_end_of_turn(request, make_cfg, which):
    folder = request.getfixturevalue(which)
    tok = targets.load_tokenizer(folder, make_cfg().target)
    for conv in (CONV, CONV[1:]):  # with and without a system prompt (SmolLM2 inserts a default one)
        ids, mask = tokenize_with_mask(tok, conv)
        assert tok.decode(ids) == tok.apply_chat_template(conv, tokenize=False)
        assert supervised_runs(tok, ids, mask) == [
            m["content"] + tok.eos_token for m in conv if m["role"] == "assistant"
        ]
    assert tok.eos_token == "<|im_end|>"


def test_prepare_stage_on_smollm2_chitchat(make_cfg, tmp_path):
    cfg = make_cfg("data.limit=6", "prepare.max_len=4096", run_dir=tmp_path)
    prepare.run(cfg)
    ds, stats = load_prepared(tmp_path)
    convs = {c["source_id"]: c for c in load_conversations(cfg.data)[0]}
    tok = targets.load_tokenizer(targets.resolve(cfg.target, cfg.cache_dir), cfg.target)
    assert stats["samples"] == len(ds) == 6 and ds["sample_id"] == list(range(6))
    for row in ds:
        conv = convs[row["source_id"]]
        want = [m["content"] + "<|im_end|>" for m in conv["messages"] if m["role"] == "assistant"]
        assert supervised_runs(tok, row["input_ids"], row["loss_mask"]) == want
    assert stats["supervised_tokens"] == sum(sum(m) for m in ds["loss_mask"])


def test_truncation_drops_samples_left_without_supervision_and_counts_them(make_cfg, tmp_path):
    short = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello there friend " * 20},
        ]
    }
    long = {
        "messages": [
            {"role": "user", "content": "tell me a story " * 50},
            {"role": "assistant", "content": "no"},
        ]
    }
    (tmp_path / "d.jsonl").write_text(json.dumps(short) + "\n" + json.dumps(long) + "\n")
    cfg = make_cfg(
        "target=tiny",
        "data=messages",
        f"data.path={tmp_path / 'd.jsonl'}",
        "prepare.max_len=40",
        run_dir=tmp_path / "run",
    )
    prepare.run(cfg)
    ds, stats = load_prepared(tmp_path / "run")
    assert len(ds) == 1 and len(ds[0]["input_ids"]) == 40 and any(ds[0]["loss_mask"])
    assert stats["truncated"] == 2 and stats["dropped_samples"] == {
        "no supervised token within max_len=40": 1
    }


def test_regenerate_locally_replaces_assistant_turns_with_target_output(make_cfg, tmp_path):
    """Every conversation's first reply is the target's own greedy answer to it (transformers' generate, one
    prompt at a time, as the independent reference), also when the prompts are batched longest first across
    batches."""
    cfg = make_cfg(
        "target=tiny",
        "data.limit=3",
        "prepare.regenerate=true",
        "prepare.max_new_tokens=5",
        "prepare.gen_batch_size=2",
        run_dir=tmp_path,
    )
    prepare.run(cfg)
    ds, stats = load_prepared(tmp_path)
    assert stats["regenerate"]["turns_replaced"] > 0
    original = {c["source_id"]: c for c in load_conversations(cfg.data)[0]}
    tok = targets.load_tokenizer(targets.resolve(cfg.target, cfg.cache_dir), cfg.target)
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        targets.resolve(cfg.target, cfg.cache_dir), dtype=torch.float32
    )
    firsts = set()
    assert len(ds) == 3
    for row in ds:
        first_reply = supervised_runs(tok, row["input_ids"], row["loss_mask"])[0]
        msgs = original[row["source_id"]]["messages"]
        want = next(m["content"] for m in msgs if m["role"] == "assistant")
        assert first_reply != want + "<|im_end|>"
        prompt = tok.apply_chat_template(
            msgs[: next(i for i, m in enumerate(msgs) if m["role"] == "assistant")],
            tokenize=False,
            add_generation_prompt=True,
        )
        enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
        out = model.generate(
            **enc,
            max_new_tokens=5,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        assert (
            first_reply
            == tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()
            + "<|im_end|>"
        )
        firsts.add(first_reply)
    assert len(firsts) > 1  # replies that differ: a reply handed to the wrong conversation would show


class _TestChatServer(BaseHTTPRequestHandler):
    """TEST SERVER (external boundary): speaks the OpenAI chat-completions protocol over real HTTP."""

    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _TestChatServer.seen.append(body)
        reply = f"reply to: {body['messages'][-1]['content'][:20]}"
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_regenerate_through_an_openai_compatible_endpoint(make_cfg, tmp_path):
    server = HTTPServer(("127.0.0.1", 0), _TestChatServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = make_cfg(
            "target=tiny",
            "data.limit=4",
            "prepare.regenerate=true",
            "prepare.regenerate_model=served",
            f"prepare.regenerate_endpoint=http://127.0.0.1:{server.server_port}",
            run_dir=tmp_path,
        )
        prepare.run(cfg)
    finally:
        server.shutdown()
    ds, stats = load_prepared(tmp_path)
    tok = targets.load_tokenizer(targets.resolve(cfg.target, cfg.cache_dir), cfg.target)
    assert all(
        r.startswith("reply to: ")
        for row in ds
        for r in supervised_runs(tok, row["input_ids"], row["loss_mask"])
    )
    assert _TestChatServer.seen[0]["model"] == "served" and stats["regenerate"]["turns_replaced"] == len(
        _TestChatServer.seen
    )
