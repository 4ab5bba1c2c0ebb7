"""Self-generated prompts (Magpie): the target writes user turns itself (`prepare.synthesize=N`).

The target is given only its chat template's user prefix (the template rendered for one user message, cut just
before the content: `<|im_start|>user\n` for ChatML, after any system prompt the template adds), sampled with
one seed per prompt, through the endpoint's /v1/completions or local HF generate. `filter_prompts` (pure) then
drops what is not a usable user turn, counting each reason; the kept prompts become single-user-turn
conversations `synth:<i>` whose answers regenerate writes like every other conversation's. Each generated text
is committed to regenerate's journal, so a rerun asks only for the missing ones.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.data import regenerate as regen
from pipeline.data.endpoint_client import EndpointClient, Failed, Progress
from pipeline.data.journal import key
from pipeline.errors import UserError

log = logging.getLogger(__name__)
_MARK = "EAGLEPIPExUSERxCONTENT"
REASONS = (
    "too short",
    "too long",
    "role token leak",
    "assistant-like reply",
    "garbage",
    "not English",
    "duplicate",
)
_ASSISTANTISH = re.compile(
    r"^\W*(i'?m sorry|i am sorry|sorry,|i apologi[sz]e|as an ai|as a language model|i cannot|i can'?t help|"
    r"i'?m (just )?an ai|certainly[!,.]|sure[!,.]|of course[!,.]|absolutely[!,.]|here is|here'?s|great "
    r"question)",
    re.IGNORECASE,
)
_ROLE_TEXT = re.compile(
    r"(^|\n)\s*(user|assistant|system|human|gpt)\s*:|<\|[a-z_]+\|>|\[/?INST\]|<</?SYS>>", re.IGNORECASE
)
_ENGLISH = frozenset(
    "the a an and or of to in is are was be it this that what how why who which can you i me my "
    "we your for on with do does please write give tell explain me about from if".split()
)


def user_prefix(tok, system: str | None = None) -> str:
    """The text a user turn's content follows, as the template renders it (with its default system prompt if
    it
    adds one, or `system`)."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _MARK}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    k = text.find(_MARK)
    if k < 0:
        raise UserError(
            "prepare.synthesize: the chat template does not render the user's text as given; "
            "cannot find where a user turn starts"
        )
    return text[:k]


def normalised(text: str) -> str:
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def _why_dropped(text: str, min_chars: int, max_chars: int, special: tuple[str, ...]) -> str | None:
    if len(text) < min_chars:
        return "too short"
    if len(text) > max_chars:
        return "too long"
    if any(s and s in text for s in special) or _ROLE_TEXT.search(text):
        return "role token leak"
    if _ASSISTANTISH.search(text):
        return "assistant-like reply"
    words = text.split()
    if re.search(r"(.)\1{19,}", text) or (len(words) >= 10 and len(set(words)) / len(words) < 0.3):
        return "garbage"
    letters = [c for c in text if c.isalpha()]
    visible = [c for c in text if not c.isspace()]
    if (
        len(letters) < 0.5 * len(visible)
        or sum(c.isascii() for c in letters) < 0.9 * len(letters)
        or (len(words) >= 4 and not _ENGLISH & {normalised(w) for w in words})
    ):
        return "not English"
    return None


def filter_prompts(
    texts: list[str],
    existing: Iterable[str],
    min_chars: int,
    max_chars: int,
    special_tokens: Iterable[str] = (),
) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """(kept (index, stripped text), drops per reason, every reason present). A text is dropped for the first
    of REASONS it meets; `duplicate` is against the texts kept before it and against `existing` (first user
    turns)."""
    special = tuple(special_tokens)
    seen = {normalised(t) for t in existing}
    drops = dict.fromkeys(REASONS, 0)
    kept = []
    for i, raw in enumerate(texts):
        text = raw.strip()
        why = _why_dropped(text, min_chars, max_chars, special)
        if why is None and normalised(text) in seen:
            why = "duplicate"
        if why:
            drops[why] += 1
            continue
        seen.add(normalised(text))
        kept.append((i, text))
    return kept, drops


def synthesize(cfg, folder: Path, tok, convs: list[dict], endpoint: str | None = None) -> dict:
    """Append the kept synthesized prompts to `convs` (assistant turns empty, for regenerate to answer);
    returns
    stats.json's `synthesize` block."""
    p = cfg.prepare
    endpoint = endpoint or p.regenerate_endpoint
    prefix = user_prefix(tok, p.synthesize_system)
    keys = [
        key("synth", i, prefix, p.synthesize_max_new_tokens, p.synthesize_temperature, cfg.seed)
        for i in range(p.synthesize)
    ]
    with regen.open_journal(cfg, folder, endpoint) as journal:
        missing = [i for i, k in enumerate(keys) if journal.get(k) is None]
        failures = _generate(cfg, folder, tok, endpoint, prefix, keys, missing, journal) if missing else {}
        texts = [journal.get(k)["text"] if journal.get(k) else "" for k in keys]
    firsts = [next((m["content"] for m in c["messages"] if m["role"] == "user"), "") for c in convs]
    asked = [i for i, k in enumerate(keys) if texts[i] or not failures]
    kept, drops = filter_prompts(
        [texts[i] for i in asked],
        firsts,
        p.synthesize_min_chars,
        p.synthesize_max_chars,
        tok.all_special_tokens,
    )
    system = [{"role": "system", "content": p.synthesize_system}] if p.synthesize_system else []
    for j, text in kept:
        convs.append(
            {
                "source_id": f"synth:{asked[j]}",
                "messages": system
                + [{"role": "user", "content": text}, {"role": "assistant", "content": ""}],
            }
        )
    log.info(
        "synthesize: %d of %d prompts kept (dropped: %s; failed requests: %s)",
        len(kept),
        p.synthesize,
        {r: n for r, n in drops.items() if n} or "none",
        failures or "none",
    )
    return {
        "asked": p.synthesize,
        "kept": len(kept),
        "dropped": drops,
        "failed_requests": failures,
        "from_journal": p.synthesize - len(missing),
        "user_prefix": prefix,
        "temperature": p.synthesize_temperature,
        "max_new_tokens": p.synthesize_max_new_tokens,
    }


def _generate(cfg, folder, tok, endpoint, prefix: str, keys: list[str], missing: list[int], journal) -> dict:
    """Generate the missing prompts into the journal; returns failed requests per reason
    (on_failed_request=drop),
    or raises the one-line error (fail)."""
    p = cfg.prepare
    progress = Progress("prepare|synthesize", len(missing))
    if not endpoint:
        generate = regen.local_generator(cfg, folder, tok)

        def commit(j: int, text: str, tokens: int) -> None:
            journal.commit(keys[missing[j]], text, tokens)
            progress.add(tokens, 1)

        generate(
            [prefix] * len(missing),
            commit,
            max_new_tokens=p.synthesize_max_new_tokens,
            temperature=p.synthesize_temperature,
            seed=cfg.seed,
        )
        progress.close()
        return {}
    client = EndpointClient(p, endpoint, p.regenerate_model or cfg.target.name, tok)
    failed: dict[int, str] = {}

    def one(i: int) -> None:
        try:
            text, tokens = client.complete(
                prefix,
                p.synthesize_max_new_tokens,
                p.synthesize_temperature,
                seed=cfg.seed * 1_000_003 + i,
                stop=[tok.eos_token] if tok.eos_token else [],
            )
        except Failed as e:
            failed[i] = e.reason
            return
        journal.commit(keys[i], text, tokens)
        progress.add(tokens, 1)

    try:
        with ThreadPoolExecutor(p.endpoint_concurrency) as pool:
            list(pool.map(one, missing))
    finally:
        client.close()
        progress.close()
    counts = {r: list(failed.values()).count(r) for r in sorted(set(failed.values()))}
    if failed and p.on_failed_request != "drop":
        raise UserError(
            f"synthesize through {client.base}: {len(failed)} of {len(missing)} requests failed after "
            f"{p.endpoint_retries} retries ({', '.join(f'{n} {r}' for r, n in counts.items())}); "
            f"{len(journal.done)} texts are committed in {journal.path}: rerun the same command to "
            "resume, or set prepare.on_failed_request=drop"
        )
    return counts
