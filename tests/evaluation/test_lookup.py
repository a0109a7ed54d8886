"""Prompt lookup proposals on hand-made token sequences: vLLM's ``ngram`` semantics."""

from __future__ import annotations

import pytest
import torch

from evaluation.lookup import LookupProposer, NoProposer, lookup_proposal


def test_the_tokens_after_the_earlier_occurrence_of_the_suffix_are_proposed():
    # vLLM's own example: the suffix [2, 3] recurs at 1..2; three tokens follow it before the end.
    assert lookup_proposal([1, 2, 3, 4, 2, 3], 4, min_n=2, max_n=2) == [4, 2, 3]
    assert lookup_proposal([1, 2, 3, 4, 2, 3], 2, min_n=2, max_n=2) == [4, 2]


def test_the_longest_recurring_suffix_wins_over_a_shorter_one_that_recurs_earlier():
    #          0  1  2  3  4  5  6  7  8  9
    context = [8, 3, 5, 9, 2, 3, 5, 6, 2, 3, 5]
    # [3, 5] recurs first at 1 (followed by 9), but [2, 3, 5] recurs at 4 (followed by 6).
    assert lookup_proposal(context, 1, min_n=2, max_n=3) == [6]
    assert lookup_proposal(context, 1, min_n=2, max_n=2) == [9]


def test_of_equally_long_matches_the_first_occurrence_is_taken():
    context = [4, 7, 1, 4, 7, 2, 4, 7]  # [4, 7] at 0 (then 1) and at 3 (then 2)
    assert lookup_proposal(context, 2, min_n=2, max_n=4) == [1, 4]


def test_max_n_caps_the_match_so_a_longer_recurrence_is_not_preferred():
    #          0  1  2  3  4  5  6  7  8  9 10 11
    context = [1, 2, 3, 0, 9, 1, 2, 3, 5, 9, 1, 2, 3]
    # [9, 1, 2, 3] recurs at 4 (then 5); capped at 3 tokens, [1, 2, 3] recurs first at 0 (then 0).
    assert lookup_proposal(context, 1, min_n=1, max_n=4) == [5]
    assert lookup_proposal(context, 1, min_n=1, max_n=3) == [0]


def test_nothing_is_proposed_without_a_recurring_suffix_of_min_n_tokens():
    assert lookup_proposal([1, 2, 3, 4], 3, min_n=1, max_n=3) == []
    assert lookup_proposal([5, 1, 6, 1], 3, min_n=2, max_n=3) == []  # only the 1-gram [1] recurs
    assert lookup_proposal([5, 1, 6, 1], 3, min_n=1, max_n=3) == [6, 1]
    assert lookup_proposal([7], 3, min_n=1, max_n=3) == []
    assert lookup_proposal([], 3, min_n=1, max_n=3) == []


def test_an_occurrence_may_overlap_the_suffix_so_a_run_proposes_itself():
    assert lookup_proposal([7, 7, 7], 3, min_n=2, max_n=2) == [7]
    assert lookup_proposal([3, 7, 7, 7, 7], 3, min_n=2, max_n=3) == [7]  # [7, 7, 7] at 1, then one 7


def test_the_proposer_sees_the_prompts_first_token_and_every_token_extend_hands_over():
    proposer = LookupProposer(1, min_n=2, max_n=3)
    proposer.extend(torch.zeros(3, 6), [2, 3, 1])  # the prompt's positions 0..2 and the newest token
    assert proposer.propose(4) == []  # [3, 1] never occurred before
    proposer.extend(torch.zeros(1, 6), [2])
    assert proposer.context == [1, 2, 3, 1, 2] and proposer.propose(4) == [3, 1, 2]
    assert NoProposer().propose(4) == []


def test_bounds_that_match_nothing_are_refused():
    with pytest.raises(ValueError):
        LookupProposer(0, min_n=3, max_n=2)
    with pytest.raises(ValueError):
        LookupProposer(0, min_n=0, max_n=2)
