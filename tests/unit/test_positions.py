"""Validation at evaluate's positions (pipeline/training/positions.py) on collate's own masks: which positions
are scored, against which token, with the draft's proposals mapped to target ids as the engines map them."""

import torch

from pipeline.data.features_dataset import answer_index as sample_answer_index
from pipeline.training.positions import answer_index, eval_positions, token_hits

# one sample: prompt p0 p1, an answer a0 a1 a2 a3 (a3 its end-of-turn token), then "\n"
X = [5, 6, 10, 11, 12, 13, 7]
L = torch.tensor([0, 0, 1, 1, 1, 1, 0])
# collate: position t holds x[t+1], scored iff l[t+1] and l[t+2]
IDS = torch.tensor(X[1:])  # p1 a0 a1 a2 a3 \n
MASK = L[1:] & torch.cat([L[2:], torch.zeros(1, dtype=L.dtype)])
DOC = torch.zeros(6, dtype=torch.long)
D2T = torch.full((20,), 10)  # draft id k -> target id k + 10


def test_collates_mask_scores_the_end_of_turn_prediction_never_the_token_after_it():
    assert MASK.tolist() == [0, 1, 1, 1, 0, 0]  # a0->a1, a1->a2, a2->a3 (EOS); not a3->"\n"
    assert sample_answer_index(L)[1:].tolist() == [-1, 0, 1, 2, 3, -1]


def test_answer_index_restarts_at_each_answer_and_each_document():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1, 0])
    doc = torch.tensor([0, 0, 0, 0, 0, 0, 0, 1, 1, 1])
    assert answer_index(mask, doc).tolist() == [-1, 0, 1, 2, -1, 0, 1, 0, 1, -1]


def test_hits_at_evaluates_positions_against_the_next_token_through_d2t():
    proposal = torch.tensor([0, 1, 2, 3, 0, 0])  # + 10: a1, a2, a3 at t = 1, 2, 3
    j = sample_answer_index(L)[1:]
    out = token_hits(proposal, IDS, MASK, DOC, D2T, eval_tokens=3, j=j)
    assert (out["token_acc_0_sum"], out["token_acc_0_total"]) == (3, 3)  # the EOS prediction included
    # evaluate with 3 new tokens (a0 a1 a2) scores a1 and a2: inputs j = 0, 1
    assert (out["evalpos_token_acc_0_sum"], out["evalpos_token_acc_0_total"]) == (2, 2)
    assert eval_positions(MASK, DOC, 3, j).tolist() == [False, True, True, False, False, False]
    # without d2t the same proposals miss: the mapping is what makes them hits
    assert (
        token_hits(proposal, IDS, MASK, DOC, torch.zeros(20, dtype=torch.long), 3, j)["token_acc_0_sum"] == 0
    )


def test_a_split_window_counts_answer_positions_from_the_samples_answer_start():
    """A later window starts mid-answer: its first scored position is not an answer's start."""
    mask = torch.tensor([0, 0, 1, 1, 1])  # context positions masked, then answer tokens 40.. of a long answer
    j = torch.tensor([38, 39, 40, 41, 42])
    assert not eval_positions(mask, torch.zeros(5, dtype=torch.long), 24, j).any()
    assert eval_positions(mask, torch.zeros(5, dtype=torch.long), 24).any()  # what the mask alone would say


def test_a_proposal_is_never_scored_against_the_next_documents_first_token():
    ids = torch.tensor([1, 2, 3, 4])
    mask = torch.tensor([1, 1, 1, 1])
    doc = torch.tensor([0, 0, 1, 1])
    out = token_hits(torch.tensor([2, 3, 4, 0]), ids, mask, doc, torch.zeros(8, dtype=torch.long), 64)
    assert (out["token_acc_0_sum"], out["token_acc_0_total"]) == (2, 2)  # positions 0 and 2 only
