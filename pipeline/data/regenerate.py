"""Replace assistant turns with the target's own answers (the draft must learn the target's distribution).

Two back-ends: any OpenAI-compatible server (`prepare.regenerate_endpoint`, or the server prepare starts from
`prepare.regenerate_server`), or local batched HF generation. Through a server each conversation advances
through its assistant turns on its own (`prepare.endpoint_concurrency` conversations in flight), so a long
conversation never holds the others back; locally the r-th turns of all conversations are batched together.

Every reply is committed to a journal (pipeline/data/journal.py) as it comes: a rerun of the same prepare asks
only for what is not there. A failed request is retried `prepare.endpoint_retries` times with backoff, then
counted by reason; the run ends with one line naming the counts (committed replies stay) unless
`prepare.on_failed_request=drop`, which drops those conversations and counts them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pipeline.data.endpoint_client import EndpointClient, Progress, over_endpoint, prompt_too_long, turn_key
from pipeline.data.journal import Journal
from pipeline.errors import UserError
from pipeline.fingerprint import digest
from pipeline.models import targets

log = logging.getLogger(__name__)


def journal_folder(cfg) -> Path:
    return Path(cfg.run_dir) / "prepared.partial"


def settings(cfg, folder: Path, endpoint: str | None) -> dict:
    """What shapes a generated text (the journal's fingerprint): not the URL, the concurrency or the
    timeouts."""
    p = cfg.prepare
    s = {
        "target": targets.fingerprint(folder),
        "max_new_tokens": p.max_new_tokens,
        "temperature": p.temperature,
    }
    if endpoint:
        s |= {"backend": "endpoint", "model": p.regenerate_model or cfg.target.name}
    else:
        device, dtype = targets.pick_device_dtype(cfg.extract.device, cfg.extract.dtype)
        s |= {
            "backend": "local",
            "device": str(torch.device(device).type),
            "dtype": str(dtype),
            "gen_batch_size": p.gen_batch_size,
        }
    if p.temperature > 0 or p.synthesize:
        s["seed"] = cfg.seed
    return s


def open_journal(cfg, folder: Path, endpoint: str | None) -> Journal:
    j = Journal(journal_folder(cfg), digest(settings(cfg, folder, endpoint)))
    if j.done:
        log.info(
            "regenerate: resuming from %s (%d texts committed%s)",
            j.path,
            len(j.done),
            ", a torn last line cut off" if j.torn else "",
        )
    if j.others:
        log.info("regenerate: not reading %s (written with other generation settings)", ", ".join(j.others))
    return j


def answer_key(cfg, folder: Path, tok) -> dict:
    """What determines an answer (formats/answers.py KEY_FIELDS): matched before any kept answer is reused."""
    return {
        "target": targets.weights_fingerprint(folder),
        "tokenizer": digest([sorted(tok.get_vocab().items()), tok.all_special_tokens]),
        "chat_template": targets.chat_template_hash(tok),
        "temperature": float(cfg.prepare.temperature),
        "max_new_tokens": int(cfg.prepare.max_new_tokens),
    }


def kept_answer_files(cfg) -> list[Path]:
    """prepare.answers, or (null) every data/answers/*.jsonl.xz of this repository."""
    if cfg.prepare.answers is not None:
        return [Path(x).expanduser() for x in cfg.prepare.answers]
    return sorted((Path(__file__).resolve().parents[2] / "data" / "answers").glob("*.jsonl.xz"))


def _usable(have: dict, want: dict) -> str | None:
    """Why a kept file cannot serve this run (None: it can; max_new_tokens is settled per answer)."""
    if want["temperature"] != 0:
        return f"prepare.temperature={want['temperature']} samples: only temperature-0 answers are reused"
    for k in ("target", "tokenizer", "chat_template", "temperature"):
        if have.get(k) != want[k]:
            return f"another {k} ({have.get(k)} here, {want[k]} in this run)"
    return None


def _serve(tok, rec: dict, M: int, N: int):
    """(text, tokens, cut) a kept answer of budget M gives a run of budget N, or why not (a count's name)."""
    text, n = rec["a"], rec["n"]
    if n > N:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) != n:
            return "retokenizes"
        return tok.decode(ids[:N]).strip(), N, 1  # stripped as a fresh answer is (endpoint_client, local)
    if n >= M and N > M:  # cut at its own budget: what follows is unknown
        return "longer_budget"
    return text, n, 0


def reuse_answers(cfg, folder: Path, tok, convs: list[dict], journal: Journal, quiet: bool = False) -> dict:
    """Commit to the journal every turn a kept answer serves, before anything is asked (docs/answers.md).
    A greedy answer of n tokens kept with budget M serves budget N when n < M (it ended by itself) and
    n <= N, or when n > N (its first N tokens, if its text re-tokenizes to the n tokens it was generated as).
    Returns the counts: used, and each reason a turn was left to regenerate."""
    from pipeline.formats import answers

    counts = {"files": [], "used": 0, "cut_to_budget": 0, "not_kept": 0, "longer_budget": 0, "retokenizes": 0}
    files = kept_answer_files(cfg)
    if not files:
        return counts
    want = answer_key(cfg, folder, tok)
    usable = []
    for path in files:
        if not path.is_file():
            raise UserError(f"prepare.answers: {path} does not exist")
        kept = answers.read(path)
        why = _usable(kept.key, want)
        counts["files"].append({"path": str(path), "answers": len(kept.by_prompt), "refused": why})
        if why:
            if not quiet:
                log.warning("prepare: kept answers %s not used: %s", path, why)
            continue
        usable.append(kept)
    if not usable:
        return counts
    N = want["max_new_tokens"]
    for c in convs:
        for i, m in enumerate(c["messages"]):
            if m["role"] != "assistant":
                continue
            k = turn_key(c, i)
            if (done := journal.get(k)) is not None:  # committed before (a rerun): later turns follow it
                c["messages"][i] = {"role": "assistant", "content": done["text"]}
                continue
            prompt = c["messages"][:i]
            found = [(kept.key["max_new_tokens"], rec) for kept in usable if (rec := kept.get(prompt))]
            tried = [_serve(tok, rec, M, N) for M, rec in found]  # a served answer, or why not
            served = next((x for x in tried if isinstance(x, tuple)), None)
            if served is None:
                counts[tried[0] if tried else "not_kept"] += 1
                break  # a later turn's prompt holds this turn's answer: it is regenerated too
            text, n, cut = served
            counts["cut_to_budget"] += cut
            journal.commit(k, text, n)
            c["messages"][i] = {"role": "assistant", "content": text}
            counts["used"] += 1
    (log.debug if quiet else log.info)(
        "prepare: %d turns answered from kept answers (%d cut to max_new_tokens=%d); regenerated: %d not "
        "kept, %d cut shorter than this budget, %d whose text does not re-tokenize to its length",
        counts["used"],
        counts["cut_to_budget"],
        N,
        counts["not_kept"],
        counts["longer_budget"],
        counts["retokenizes"],
    )
    return counts


class _Dry:
    """A journal that holds nothing and keeps nothing: reuse_answers on it only counts."""

    def get(self, k):
        return None

    def commit(self, k, text, tokens):
        pass


def all_kept(cfg, folder: Path, tok, convs: list[dict]) -> bool:
    """Whether kept answers serve every assistant turn of convs (then no server need be started)."""
    import copy

    turns = sum(m["role"] == "assistant" for c in convs for m in c["messages"])
    return reuse_answers(cfg, folder, tok, copy.deepcopy(convs), _Dry(), quiet=True)["used"] == turns


def answers_path(cfg) -> Path:
    return journal_folder(cfg) / "answers.jsonl.xz"


def keep_answers(
    cfg,
    folder: Path,
    tok,
    convs: list[dict],
    journal: Journal,
    endpoint: str | None,
    kept: dict,
    given: str | None = None,
) -> Path | None:
    """Every regenerated turn as (prompt, answer, tokens) in run_dir/prepared.partial/answers.jsonl.xz, the
    file `data/answers/` keeps (docs/answers.md)."""
    from pipeline.formats import answers

    records = []
    for c in convs:
        for i, m in enumerate(c["messages"]):
            if m["role"] == "assistant" and (rec := journal.get(turn_key(c, i))) is not None:
                records.append((c["messages"][:i], rec["text"], rec["tokens"]))
    how = settings(cfg, folder, endpoint)
    produced_by = {k: v for k, v in how.items() if k not in ("max_new_tokens", "temperature")}
    if given:  # eaglepipe did not start it: what it serves is the user's word (docs/answers.md)
        produced_by["endpoint_given"] = "prepare.regenerate_endpoint: not checked to serve this target"
    if kept["used"]:  # those answers were made by what made the kept files
        produced_by["kept_answers"] = {"used": kept["used"], "files": [f["path"] for f in kept["files"]]}
    path = answers_path(cfg)
    try:
        n = answers.write(path, answer_key(cfg, folder, tok), produced_by, records)
    except answers.NoRoom as e:  # the journal beside it still holds every answer: nothing is lost
        log.warning("regenerate: answers not kept (%s); the journal %s holds them", e, journal.path)
        return None
    log.info(
        "regenerate: %d answers kept in %s (docs/answers.md: how to keep them in data/answers/)", n, path
    )
    return path


def regenerate(cfg, folder: Path, tok, convs: list[dict], endpoint: str | None = None) -> dict:
    """Replace every assistant turn of `convs` in place (with on_failed_request=drop, the failed conversations
    are removed from the list); returns stats.json's `regenerate` block."""
    p = cfg.prepare
    given = (
        None if endpoint else p.regenerate_endpoint
    )  # a server the user runs: not checked to be the target
    endpoint = endpoint or p.regenerate_endpoint
    with open_journal(cfg, folder, endpoint) as journal:
        kept = reuse_answers(cfg, folder, tok, convs, journal)
        if endpoint:
            client = EndpointClient(p, endpoint, p.regenerate_model or cfg.target.name, tok)
            stats = over_endpoint(cfg, client, convs, journal)
        else:
            stats = _locally(cfg, folder, tok, convs, journal)
        kept_path = keep_answers(cfg, folder, tok, convs, journal, endpoint, kept, given)
        stats["answers_file"] = str(kept_path) if kept_path else None
    stats["kept_answers"] = kept
    stats |= {"max_new_tokens": p.max_new_tokens, "temperature": p.temperature, "journal": str(journal.path)}
    log.info(
        "regenerate (%s): %d assistant turns (%d from the journal), %d completion tokens in %.1f s "
        "(%.1f tokens/s), %d requests, %d retries, failures %s, %d empty replies",
        stats["backend"],
        stats["turns_replaced"],
        stats["turns_from_journal"],
        stats["completion_tokens"],
        stats["wall_s"],
        stats["tokens_per_s"],
        stats["requests"],
        stats["retries"],
        stats["failures"] or "none",
        stats["empty_replies"],
    )
    return stats


def _locally(cfg, folder: Path, tok, convs: list[dict], journal: Journal) -> dict:
    """Round r batches the r-th assistant turn of every conversation; each batch is committed as it ends."""
    progress = Progress("prepare|regenerate (local)", len(convs))
    generate = None
    rounds = max((sum(m["role"] == "assistant" for m in c["messages"]) for c in convs), default=0)
    replaced = from_journal = empty = cut_long = 0
    for r in range(rounds):
        todo = []  # (conversation, index of its r-th assistant turn, key)
        for c in convs:
            idx = [i for i, m in enumerate(c["messages"]) if m["role"] == "assistant"]
            if r < len(idx):
                k = turn_key(c, idx[r])
                if (
                    r
                    and journal.get(k) is None
                    and prompt_too_long(tok, c["messages"][: idx[r]], cfg.prepare.max_len)
                ):
                    c["messages"] = c["messages"][: idx[r]]  # never generated (see prompt_too_long), counted
                    cut_long += 1
                    continue
                todo.append((c, idx[r], k))
        missing = [t for t in todo if journal.get(t[2]) is None]
        from_journal += len(todo) - len(missing)
        if missing:
            generate = generate or local_generator(cfg, folder, tok)

            def commit(j: int, text: str, tokens: int, missing=missing) -> None:
                journal.commit(missing[j][2], text, tokens)
                progress.add(tokens)

            generate([c["messages"][:i] for c, i, _ in missing], commit)
        for c, i, k in todo:
            text = journal.get(k)["text"]
            c["messages"][i] = {"role": "assistant", "content": text}
            replaced += 1
            empty += not text
        progress.add(
            items=sum(1 for c in convs if sum(m["role"] == "assistant" for m in c["messages"]) == r + 1)
        )
    figures = progress.close()
    return {
        "backend": "local HF generate",
        "turns_replaced": replaced,
        "cut_at_a_long_prompt": cut_long,
        "turns_from_journal": from_journal,
        **figures,
        "requests": 0,
        "retries": 0,
        "empty_replies": empty,
        "failures": {},
        "dropped_conversations": 0,
    }


def local_generator(cfg, folder: Path, tok, sample: bool = False):
    """generate(prompts, commit): prompts are message lists (chat template applied) or raw text; commit(j,
    text, new tokens) is called for each prompt as its batch ends. Batched longest first, so a batch holds
    prompts of similar length (little left padding) and the largest batch comes first (an out-of-memory shows
    at
    once)."""
    device, dtype = targets.pick_device_dtype(cfg.extract.device, cfg.extract.dtype)
    model = targets.load_model(folder, cfg.target, device, dtype)
    p = cfg.prepare
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    def generate(
        prompts: list,
        commit,
        max_new_tokens: int = p.max_new_tokens,
        temperature: float = p.temperature,
        seed: int = 0,
    ) -> None:
        texts = [
            t
            if isinstance(t, str)
            else tok.apply_chat_template(t, tokenize=False, add_generation_prompt=True)
            for t in prompts
        ]
        lengths = [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]] if texts else []
        order = sorted(range(len(texts)), key=lambda i: -lengths[i])
        for b, s in enumerate(range(0, len(order), p.gen_batch_size)):
            rows = order[s : s + p.gen_batch_size]
            enc = tok(
                [texts[i] for i in rows], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(device)
            if temperature > 0:
                torch.manual_seed(seed * 1_000_003 + b)  # one seed per batch: the same texts on a rerun
            with torch.inference_mode():
                gen = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    do_sample=temperature > 0,
                    temperature=temperature if temperature > 0 else None,
                    top_p=None,
                    top_k=None,
                    eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id,
                )
            new = gen[:, enc["input_ids"].shape[1] :]
            counts = (new != tok.pad_token_id).sum(1).tolist()
            for i, t, n in zip(rows, tok.batch_decode(new, skip_special_tokens=True), counts):
                commit(i, t.strip(), int(n))

    return generate
