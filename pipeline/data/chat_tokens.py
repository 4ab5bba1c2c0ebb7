"""Conversations as training tokens: the chat template applied, the loss mask exactly over what the assistant
says (its content plus the end-of-turn tokens), conversations cut to a number of assistant turns, prompts too
long for the target's context cut or dropped.
"""

from __future__ import annotations

import logging

import numpy as np
from tqdm import tqdm

from pipeline.data.sources import Problems

log = logging.getLogger(__name__)


def cut_turns(convs: list[dict], max_turns: int | None) -> int:
    """Keep each conversation up to and including its max_turns-th assistant turn; returns how many were
    cut."""
    if not max_turns:
        return 0
    cut = 0
    for c in convs:
        idx = [i for i, m in enumerate(c["messages"]) if m["role"] == "assistant"]
        if len(idx) > max_turns:
            c["messages"] = c["messages"][: idx[max_turns - 1] + 1]
            cut += 1
    return cut


def cut_long_prompts(tok, convs: list[dict], max_len: int) -> tuple[list[dict], dict]:
    """Before regeneration: cut each conversation before its first assistant turn whose prompt (the
    chat-templated turns before it) holds max_len tokens or more; a conversation left without an assistant
    turn is dropped. Samples are cut at max_len, so such an answer would never be trained on, and a server
    refuses a prompt longer
    than its context (HTTP 400: 19 ShareGPT first turns on the H200, 2026-12-03). Counted, never silent."""
    kept, cut, dropped, refused = [], 0, 0, Problems("skip", "prepare")
    for c in convs:
        msgs = c["messages"]
        try:
            for i, m in enumerate(msgs):
                if (
                    m["role"] != "assistant" or i == 0
                ):  # a leading answer: tokenize_with_mask drops it, counted
                    continue
                prompt = render(tok, msgs[:i], add_generation_prompt=True)
                if len(tok(prompt, add_special_tokens=False)["input_ids"]) >= max_len:
                    c["messages"] = msgs[:i]
                    cut += 1
                    break
        except TemplateError as e:  # never sent to be answered: counted as tokenize_all counts it
            refused.report(str(e), c["source_id"])
            continue
        if any(m["role"] == "assistant" for m in c["messages"]):
            kept.append(c)
        else:
            dropped += 1
    refused.log_summary()
    if cut:
        log.info(
            "prepare: %d conversations cut before an assistant turn whose prompt holds >= prepare.max_len=%d "
            "tokens (%d of them left with no assistant turn, dropped)",
            cut,
            max_len,
            dropped,
        )
    return kept, {"cut": cut, "dropped": dropped, "max_len": max_len, "template_refused": refused.as_dict()}


class TemplateError(Exception):
    pass


def render(tok, messages: list[dict], **kw) -> str:
    """The chat template applied; a template that refuses the conversation (jinja's raise_exception, e.g.
    "Conversation roles must alternate", or a field it lacks) is a TemplateError naming its message: that
    conversation is skipped and counted, not the run stopped."""
    import jinja2

    try:
        return tok.apply_chat_template(messages, tokenize=False, **kw)
    except jinja2.TemplateError as e:
        raise TemplateError(f"the chat template refused it: {e}") from None


def assistant_spans(tok, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation; return the text and the character spans the draft must learn to emit.

    Uses only the template's prefix property: rendering messages[:i] with the generation prompt must be a
    prefix of rendering messages[:i+1], which must be a prefix of the full text (true of ChatML, Llama-3,
    Qwen templates). A template that breaks it fails loudly instead of producing a wrong mask.
    """
    full = render(tok, messages)
    eot = tok.eos_token
    if not eot:
        raise TemplateError("tokenizer has no eos token to close assistant turns")
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise TemplateError("conversation starts with an assistant turn")
        prefix = render(tok, messages[:i], add_generation_prompt=True)
        upto = render(tok, messages[: i + 1])
        if not (full.startswith(upto) and upto.startswith(prefix)):
            raise TemplateError("chat template is not prefix-stable for this conversation")
        k = upto.find(eot, len(prefix))
        if k < 0:
            raise TemplateError(f"assistant turn not closed by the end-of-turn token {eot!r}")
        spans.append((len(prefix), k + len(eot)))
    return full, spans


def tokenize_with_mask(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    text, spans = assistant_spans(tok, messages)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.array([a for a, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=np.uint8)
    for a, b in spans:
        mask |= ((starts >= a) & (starts < b)).astype(np.uint8)
    return list(enc["input_ids"]), mask.tolist()


def tokenize_all(tok, convs: list[dict], max_len: int) -> tuple[dict, Problems, list[int], int]:
    """Every conversation as a sample: (rows {input_ids, loss_mask, sample_id, source_id}, what was dropped
    and why, the sample ids of held-out conversations, how many were cut to max_len)."""
    rows = {"input_ids": [], "loss_mask": [], "sample_id": [], "source_id": []}
    drops = Problems("skip", "prepare")
    heldout = []  # sample ids of the conversations data=mix set aside: train validates on exactly these
    truncated = 0
    for conv in tqdm(convs, desc="prepare|tokenize", mininterval=1.0):
        try:
            ids, mask = tokenize_with_mask(tok, conv["messages"])
        except TemplateError as e:
            drops.report(str(e), conv["source_id"])
            continue
        if len(ids) > max_len:
            truncated += 1
            ids, mask = ids[:max_len], mask[:max_len]
        if not any(mask):
            drops.report(f"no supervised token within max_len={max_len}", conv["source_id"])
            continue
        rows["sample_id"].append(len(rows["sample_id"]))
        rows["source_id"].append(conv["source_id"])
        rows["input_ids"].append(ids)
        rows["loss_mask"].append(mask)
        if conv.get("heldout"):
            heldout.append(rows["sample_id"][-1])
    return rows, drops, heldout, truncated
