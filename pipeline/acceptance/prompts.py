"""The prompts evaluate measures on (and tools/tune_serve chooses on): the standard sets through the
target's chat template (a second-turn set with the target's own first answers), and the held-out samples
train set aside, split into the half choices are made on and the half that is reported.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.acceptance import offline as offline_bench
from pipeline.data import prompt_sets
from pipeline.errors import UserError
from pipeline.formats import train_summary
from pipeline.formats.run_dir import RunDir

log = logging.getLogger(__name__)


def set_prompts(cfg, store, name: str, n: int, prompt_tokens: int, bench=None) -> list[list[int]]:
    """The first n prompts of a standard set that fit, each through the target's chat template: one user
    message of at most prompt_tokens tokens; for a second-turn set (mt_bench_turn2), the first turn, the
    target's own greedy answer to it (`bench.greedy_answers`, at most eval.first_answer_tokens) and the second
    turn, at most
    prompt_tokens + eval.first_answer_tokens. The ones too long are counted in the log."""
    from pipeline.models import targets

    tok = targets.load_tokenizer(Path(store.facts["target_path"]), cfg.target)

    def ids_of(messages: list[dict]) -> list[int]:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    first_of = prompt_sets.SECOND_TURN.get(name)
    rows = prompt_sets.load(first_of or name)
    if first_of:
        rows = [r for r in rows if len(r["turns"]) > 1]
    firsts, too_long = [], 0
    for row in rows:
        ids = ids_of([{"role": "user", "content": row["text"]}])
        if len(ids) > prompt_tokens:
            too_long += 1
            continue
        firsts.append((row, ids))
        if not first_of and len(firsts) >= n:
            break
    if not first_of:
        prompts = [ids for _, ids in firsts]
    else:  # the target answers the first turns n at a time until n second-turn prompts fit (or none are left)
        bench = bench or offline_bench
        limit, prompts = prompt_tokens + cfg.eval.first_answer_tokens, []
        log.info(
            "evaluate: %s: the target answers first turns (greedy, <= %d tokens)",
            name,
            cfg.eval.first_answer_tokens,
        )
        for a in range(0, len(firsts), n):
            chunk = firsts[a : a + n]
            answers = bench.greedy_answers(
                cfg, store, [ids for _, ids in chunk], cfg.eval.first_answer_tokens
            )
            if not all(answers):
                log.warning(
                    "evaluate: %s: %d empty first answers (the second turn follows an empty reply)",
                    name,
                    sum(not x for x in answers),
                )
            for (row, _), answer in zip(chunk, answers):
                ids = ids_of(
                    [
                        {"role": "user", "content": row["turns"][0]},
                        {"role": "assistant", "content": answer},
                        {"role": "user", "content": row["turns"][1]},
                    ]
                )
                if len(ids) > limit:
                    too_long += 1
                elif len(prompts) < n:
                    prompts.append(ids)
            if len(prompts) >= n:
                break
    if too_long:
        log.warning(
            "evaluate: %d %s prompts longer than eval.prompt_tokens=%d%s skipped",
            too_long,
            name,
            prompt_tokens,
            " (+ eval.first_answer_tokens)" if first_of else "",
        )
    if not prompts:
        raise UserError(f"no {name} prompt fits eval.prompt_tokens={prompt_tokens}; raise it")
    return prompts


def _why_none_held_out(facts: dict) -> str:
    """Why a training run held no sample out, from what it recorded: train.val_fraction=0, or too few samples
    for any fraction (train keeps at least one sample to train on)."""
    fraction = ((facts.get("config") or {}).get("train") or {}).get("val_fraction")
    n = facts.get("train_samples")
    if not fraction:
        return (
            "train.val_fraction=0): evaluate prompts only from samples the draft never saw; retrain with "
            "train.val_fraction > 0"
        )
    return (
        f"{n} training sample{'s' if n != 1 else ''} x train.val_fraction={fraction} held none out: "
        "training keeps at least one sample): evaluate prompts only from samples the draft never saw; "
        "raise data.limit (or add data) and retrain"
    )


def heldout_prompts(cfg, store, n: int, prompt_tokens: int, half: str = "report") -> list[list[int]]:
    """Prefixes of the validation samples train held out (train_summary.json's `val_samples`), report half
    (prompt_sets.selection_and_report; `half="selection"`: the other one, where choices are made), up to their
    first supervised token, i.e. up to where the assistant starts answering; at most prompt_tokens long."""
    summary = RunDir.of(cfg).train_summary
    facts = train_summary.read(summary.parent)
    if facts is None:
        raise UserError(f"no {summary}: run stage=train first")
    if "val_samples" not in facts or "tau_probe_half" not in facts:  # an older eaglepipe wrote it
        raise UserError(
            f"{summary} records no held-out split halves (an older eaglepipe trained this draft): "
            "its heldout prompts cannot be told from those a checkpoint was chosen on; retrain "
            "(train.resume=never)"
        )
    val = facts["val_samples"]
    if not val:
        raise UserError(
            f"{summary.parent} was trained with no held-out samples ({_why_none_held_out(facts)})"
        )
    selection, report = prompt_sets.selection_and_report(val)  # evaluate: never the half choices were made on
    report = selection if half == "selection" else report
    prompts = prompt_sets.before_answer(store, report, n, prompt_tokens)
    if len(prompts) < n:
        log.warning(
            "evaluate: heldout has %d prompts of the %d asked (%d held-out samples, half of them kept for "
            "training's tau probe); raise train.val_fraction for more",
            len(prompts),
            n,
            len(val),
        )
    if not prompts:
        raise UserError(
            f"none of the {len(report)} held-out samples of the report half has a prompt (the tokens before "
            "the first "
            f"supervised one) of 2 to eval.prompt_tokens={prompt_tokens} tokens; raise eval.prompt_tokens"
        )
    return prompts
