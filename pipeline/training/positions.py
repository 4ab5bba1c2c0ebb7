"""Validation at the positions evaluate scores, against the tokens the target actually wrote (issue #47).

speculators' `full_acc_0` compares the draft's step-0 argmax with the target's argmax *over the draft
vocabulary*, at every supervised position of every answer (up to prepare.max_new_tokens deep). Evaluate's
teacher-forced `acc_0` compares the draft's proposal, mapped to a target id (d2t), with the token the target
wrote next, over the first eval.max_new_tokens tokens of each answer. These two figures are what the user
compares, so validation reports, beside full_acc_0:

- `token_acc_0`: the proposal (target id) equals the next token of the sample, wherever both the input and
  the predicted token are the answer's (never past its end-of-turn token, where serving stops);
- `token_acc_0_eval_positions`: the same, only where the next token is one of the first
  eval.max_new_tokens - 1 tokens after an answer's first (evaluate's teacher-forced positions: its prompt
  ends with the generation prompt, the target writes the answer's first token, the draft is scored from
  the second on).

Collate's alignment (pipeline/data/features_dataset.py): position t holds input token x[t+1] with mask
l[t+1], and the draft's step-0 proposal there predicts x[t+2] = input_ids[t+1] of the same document.
"""

from __future__ import annotations

import torch


def answer_index(loss_mask: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """[T] index of each position's input token within its supervised run (0 = an answer's first token,
    -1 = not supervised). A run starts where the mask turns on or the document changes."""
    m = loss_mask.bool()
    T = m.shape[0]
    prev_on = torch.zeros_like(m)
    prev_on[1:] = m[:-1] & (document_ids[1:] == document_ids[:-1])
    starts = m & ~prev_on
    pos = torch.arange(T, device=m.device)
    start_at = torch.where(starts, pos, torch.zeros_like(pos))
    start_at = torch.cummax(start_at, dim=0).values
    return torch.where(m, pos - start_at, torch.full_like(pos, -1))


def token_hits(
    proposal: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    d2t: torch.Tensor,
    eval_tokens: int,
) -> dict[str, torch.Tensor]:
    """Sums and totals of token_acc_0 (all supervised positions) and token_acc_0_eval_positions for one [T]
    row: `proposal` is the step-0 argmax in draft ids, mapped to target ids as the engines map it
    (target = draft + d2t[draft])."""
    target_ids = proposal + d2t[proposal]
    nxt_same_doc = torch.zeros_like(loss_mask, dtype=torch.bool)
    nxt_same_doc[:-1] = document_ids[1:] == document_ids[:-1]
    nxt = torch.zeros_like(input_ids)
    nxt[:-1] = input_ids[1:]
    nxt_supervised = torch.zeros_like(nxt_same_doc)
    nxt_supervised[:-1] = loss_mask[1:].bool()
    # the predicted token is the answer's own (never the one after its end-of-turn: serving stops there)
    scored = loss_mask.bool() & nxt_same_doc & nxt_supervised
    hit = (target_ids == nxt) & scored
    j = answer_index(loss_mask, document_ids)
    at_eval = scored & (j >= 0) & (j <= eval_tokens - 2)  # predicts answer token j+1 <= eval_tokens-1
    return {
        "token_acc_0_sum": hit.sum(),
        "token_acc_0_total": scored.sum(),
        "token_acc_0_eval_positions_sum": (hit & at_eval).sum(),
        "token_acc_0_eval_positions_total": at_eval.sum(),
    }
