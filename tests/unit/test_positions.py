"""Validation at evaluate's positions (pipeline/training/positions.py): which positions are scored, against
which token, with the draft's proposals mapped to target ids as the engines map them."""

import torch

from pipeline.training.positions import answer_index, token_hits


def test_answer_index_restarts_at_each_answer_and_each_document():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1, 0])
    doc = torch.tensor([0, 0, 0, 0, 0, 0, 0, 1, 1, 1])
    assert answer_index(mask, doc).tolist() == [-1, 0, 1, 2, -1, 0, 1, 0, 1, -1]


def test_hits_are_counted_at_evaluates_positions_against_the_next_token_through_d2t():
    # one document: prompt (2 tokens), an answer of 6 tokens (the last its end-of-turn), then "\n"
    ids = torch.tensor([5, 6, 10, 11, 12, 13, 14, 15, 7])
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0])
    doc = torch.zeros(9, dtype=torch.long)
    d2t = torch.full((20,), 10)  # draft id k -> target id k + 10
    # proposals (draft ids) that hit every answer token after the first, and the "\n" after the end too
    proposal = torch.tensor([0, 0, 1, 2, 3, 4, 5, -3, 0])
    proposal = proposal.clamp(min=0)
    proposal[7] = 0  # predicts 10 after the end-of-turn: never scored whatever it is
    out = token_hits(proposal, ids, mask, doc, d2t, eval_tokens=4)
    # scored: inputs at 2..6 predicting 11..15 (5 positions), all hits
    assert (out["token_acc_0_sum"], out["token_acc_0_total"]) == (5, 5)
    # evaluate with 4 new tokens scores answer tokens 1..3: inputs j=0,1,2
    assert (out["evalpos_token_acc_0_sum"], out["evalpos_token_acc_0_total"]) == (3, 3)
    # without d2t the same proposals miss: the mapping is what makes them hits
    assert token_hits(proposal, ids, mask, doc, torch.zeros(20, dtype=torch.long), 4)["token_acc_0_sum"] == 0


def test_a_proposal_is_never_scored_against_the_next_documents_first_token():
    ids = torch.tensor([1, 2, 3, 4])
    mask = torch.tensor([1, 1, 1, 1])
    doc = torch.tensor([0, 0, 1, 1])
    proposal = torch.tensor([2, 3, 4, 0])
    out = token_hits(proposal, ids, mask, doc, torch.zeros(8, dtype=torch.long), 64)
    assert (out["token_acc_0_sum"], out["token_acc_0_total"]) == (2, 2)  # positions 0 and 2 only
