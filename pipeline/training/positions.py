"""Validation at the positions evaluate scores, against the tokens the target actually wrote (issue #47).

speculators' `full_acc_0` compares the draft's step-0 argmax with the target's argmax *over the draft
vocabulary*, at every supervised position of every answer (up to prepare.max_new_tokens deep). Evaluate's
teacher-forced `acc_0` compares the draft's proposal, mapped to a target id (d2t), with the token the target
wrote next, over the first eval.max_new_tokens tokens of each answer. These two figures are what the user
compares, so validation reports, beside full_acc_0:

- `evalpos_full_acc_0`: speculators' own full_acc_0, only at evaluate's positions: where the next
  token is one of the first eval.max_new_tokens - 1 tokens after an answer's first (its prompt ends with the
  generation prompt, the target writes the answer's first token, the draft is scored from the second on);
- `token_acc_0` and `evalpos_token_acc_0`: the proposal through d2t (a target id) equals the next
  token of the sample, wherever both the input and the predicted token are the answer's (never past its
  end-of-turn token, where serving stops). On the target's own temperature-0 answers (prepare.regenerate)
  that token is the target's greedy choice: the question serving asks. On other data it is the data's.

Collate's alignment (pipeline/data/features_dataset.py): position t holds input token x[t+1] with mask
l[t+1], and the draft's step-0 proposal there predicts x[t+2] = input_ids[t+1] of the same document.
"""

from __future__ import annotations

import torch

from pipeline.data.features_dataset import answer_index


def scored(loss_mask: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """[T] positions scored against the next token of the pack: collate's mask (input and predicted token
    both the answer's) where that token is in the pack, in the same document (a window's last position
    predicts a token of the next window: speculators' full_acc_0 scores it, the token comparison cannot)."""
    out = torch.zeros_like(loss_mask, dtype=torch.bool)
    out[:-1] = loss_mask[:-1].bool() & (document_ids[1:] == document_ids[:-1])
    return out


def eval_positions(
    loss_mask: torch.Tensor, document_ids: torch.Tensor, eval_tokens: int, j: torch.Tensor | None = None
) -> torch.Tensor:
    """[T] the positions evaluate's teacher-forced acc_0 scores: the input is answer token j <= eval_tokens-2
    (it predicts token j+1 of the first eval_tokens). j: collate's `answer_index` row, else from the mask."""
    j = answer_index(loss_mask, document_ids) if j is None else j
    return scored(loss_mask, document_ids) & (j >= 0) & (j <= eval_tokens - 2)


def token_hits(
    proposal: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    d2t: torch.Tensor,
    eval_tokens: int,
    j: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Sums and totals of token_acc_0 (all scored positions) and evalpos_token_acc_0 for one [T]
    row: `proposal` is the step-0 argmax in draft ids, mapped to target ids as the engines map it
    (target = draft + d2t[draft])."""
    nxt = torch.zeros_like(input_ids)
    nxt[:-1] = input_ids[1:]
    hit = (proposal + d2t[proposal]) == nxt
    on, at_eval = scored(loss_mask, document_ids), eval_positions(loss_mask, document_ids, eval_tokens, j)
    return {
        "token_acc_0_sum": (hit & on).sum(),
        "token_acc_0_total": on.sum(),
        "evalpos_token_acc_0_sum": (hit & at_eval).sum(),
        "evalpos_token_acc_0_total": at_eval.sum(),
    }


EVALPOS = ("evalpos_full_acc_0", "token_acc_0", "evalpos_token_acc_0")


def pack_metrics(model, batch: dict, fwd: dict, d2t: torch.Tensor, eval_tokens: int) -> dict:
    """speculators' metric sums for one pack (collate(..., with_answer_index=True)), plus those of EVALPOS:
    its own step-0 accuracy with the loss mask cut to evaluate's positions (a second forward, one TTT step),
    and the token hits. Every rank makes the same two forwards (FSDP's collectives)."""
    batch = dict(batch)
    j = batch.pop("answer_index")[0]
    drafted, _, m = model(**batch, **fwd)
    at_eval = eval_positions(batch["loss_mask"][0], batch["document_ids"][0], eval_tokens, j)
    _, _, m0 = model(**(batch | {"loss_mask": at_eval[None]}), **fwd | {"ttt_steps": 1})
    m["evalpos_full_acc_0_sum"], m["evalpos_full_acc_0_total"] = m0["full_acc_0_sum"], m0["full_acc_0_total"]
    row = (batch["input_ids"][0], batch["loss_mask"][0], batch["document_ids"][0])
    return m | token_hits(drafted[0][0], *row, d2t, eval_tokens, j)


def ratios(summed: dict) -> dict:
    """EVALPOS figures from summed pack_metrics (nan where nothing was scored)."""
    return {
        name: summed[f"{name}_sum"] / summed[f"{name}_total"] if summed.get(f"{name}_total") else float("nan")
        for name in EVALPOS
    }
