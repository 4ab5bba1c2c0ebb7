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


def answer_index(loss_mask: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """[T] index of each position's input token within its supervised run (0 = an answer's first token,
    -1 = not supervised). A run starts where the mask turns on or the document changes. For packs, collate
    computes it over each whole sample instead (a split window starts mid-answer)."""
    m = loss_mask.bool()
    T = m.shape[0]
    prev_on = torch.zeros_like(m)
    prev_on[1:] = m[:-1] & (document_ids[1:] == document_ids[:-1])
    starts = m & ~prev_on
    pos = torch.arange(T, device=m.device)
    start_at = torch.where(starts, pos, torch.zeros_like(pos))
    start_at = torch.cummax(start_at, dim=0).values
    return torch.where(m, pos - start_at, torch.full_like(pos, -1))


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
