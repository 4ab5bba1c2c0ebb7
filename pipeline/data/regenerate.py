"""Replace assistant turns with the target's own answers (the draft must learn the target's distribution).

Turn by turn: the r-th assistant turn of every conversation is regenerated from the (already regenerated)
context before it, batched across conversations. Two back-ends: local batched HF generation, or any
OpenAI-compatible server (`prepare.regenerate_endpoint`, e.g. SGLang's or vLLM's /v1/chat/completions).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from pipeline.errors import UserError
from pipeline.models import targets

log = logging.getLogger(__name__)


def regenerate(cfg, folder: Path, tok, convs: list[dict]) -> dict:
    p = cfg.prepare
    if p.regenerate_endpoint:
        generate = _endpoint_generator(p, cfg.target.name)
        how = f"endpoint {p.regenerate_endpoint}"
    else:
        generate = _local_generator(cfg, folder, tok)
        how = "local HF generate"
    rounds = max(sum(m["role"] == "assistant" for m in c["messages"]) for c in convs)
    replaced = empty = 0
    for r in range(rounds):
        todo = []  # (conversation, index of its r-th assistant turn)
        for c in convs:
            idx = [i for i, m in enumerate(c["messages"]) if m["role"] == "assistant"]
            if r < len(idx):
                todo.append((c, idx[r]))
        replies = generate([c["messages"][:i] for c, i in todo], desc=f"prepare|regenerate turn {r + 1}/{rounds}")
        for (c, i), reply in zip(todo, replies):
            c["messages"][i] = {"role": "assistant", "content": reply}
            replaced += 1
            empty += not reply
    log.info("regenerate (%s): %d assistant turns replaced, %d empty replies kept", how, replaced, empty)
    return {"backend": how, "turns_replaced": replaced, "empty_replies": empty,
            "max_new_tokens": p.max_new_tokens, "temperature": p.temperature}


def _local_generator(cfg, folder: Path, tok):
    device, dtype = targets.pick_device_dtype(cfg.extract.device, cfg.extract.dtype)
    model = targets.load_model(folder, cfg.target, device, dtype)
    p = cfg.prepare
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    def generate(prefixes: list[list[dict]], desc: str) -> list[str]:
        """Replies in the prefixes' order; batched longest first, so a batch holds prompts of similar length
        (little left padding) and the largest batch comes first (an out-of-memory shows at once)."""
        texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prefixes]
        lengths = [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]] if texts else []
        order = sorted(range(len(texts)), key=lambda i: -lengths[i])
        out: list[str] = [""] * len(texts)
        for s in tqdm(range(0, len(order), p.gen_batch_size), desc=desc):
            rows = order[s: s + p.gen_batch_size]
            enc = tok([texts[i] for i in rows], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            with torch.inference_mode():
                gen = model.generate(**enc, max_new_tokens=p.max_new_tokens, do_sample=p.temperature > 0,
                                     temperature=p.temperature if p.temperature > 0 else None, top_p=None, top_k=None,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            new = gen[:, enc["input_ids"].shape[1]:]
            for i, t in zip(rows, tok.batch_decode(new, skip_special_tokens=True)):
                out[i] = t.strip()
        return out

    return generate


def _endpoint_generator(p, target_name: str):
    import httpx

    url = p.regenerate_endpoint.rstrip("/") + "/v1/chat/completions"
    model = p.regenerate_model or target_name

    def one(client: httpx.Client, messages: list[dict]) -> str:
        body = {"model": model, "messages": messages, "max_tokens": p.max_new_tokens, "temperature": p.temperature}
        for attempt in range(3):  # a transport error on one of many pooled connections is retried, twice
            try:
                r = client.post(url, json=body)
                break
            except httpx.TransportError as e:
                if attempt == 2:
                    raise UserError(f"regenerate endpoint {url}: {type(e).__name__}: {e}; is the server running?") from None
            except httpx.HTTPError as e:
                raise UserError(f"regenerate endpoint {url}: {type(e).__name__}: {e}; is the server running?") from None
        if r.status_code != 200:
            raise UserError(f"regenerate endpoint {url}: HTTP {r.status_code}: {r.text[:200]}")
        try:
            return (r.json()["choices"][0]["message"]["content"] or "").strip()
        except (ValueError, KeyError, IndexError, TypeError):
            raise UserError(f"regenerate endpoint {url}: not an OpenAI chat completion: {r.text[:200]}") from None

    def generate(prefixes: list[list[dict]], desc: str) -> list[str]:
        limits = httpx.Limits(max_connections=p.endpoint_concurrency, max_keepalive_connections=p.endpoint_concurrency)
        with httpx.Client(timeout=p.endpoint_timeout_s, limits=limits) as client, \
                ThreadPoolExecutor(p.endpoint_concurrency) as pool:
            return list(tqdm(pool.map(lambda m: one(client, m), prefixes), total=len(prefixes), desc=desc))

    return generate
