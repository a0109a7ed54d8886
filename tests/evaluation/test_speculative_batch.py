"""Batched speculative decoding against the single-sequence loop it must reproduce, row for row, on the real
tiny target: the same tokens, the same tokens per pass, for the drafter, prompt lookup and no drafter."""

from __future__ import annotations

import pytest

from evaluation.lookup import LookupProposer, NoProposer
from evaluation.speculative import DrafterProposer, speculative_generate
from evaluation.speculative_batch import (
    BatchDrafterProposer,
    RowProposers,
    prefill_batch,
    speculative_generate_batch,
)
from tests.support.tiny_runs import LAYER_IDS, demo_messages, greedy_reply, prompt_ids
from tests.evaluation.test_evaluate import OracleProposer

MAX_NEW = 40  # longer than several of the tiny target's replies: some rows stop at eos, others at the budget


@pytest.fixture(scope="module")
def prompts(tiny_target, eval_messages) -> list[list[int]]:
    # Held-out prompts and ones the trained drafter learned, of different lengths (left padding differs per row).
    return [prompt_ids(tiny_target, m) for m in [*eval_messages, *demo_messages()[:4]]]


def single(target, proposer, ids, k):
    return speculative_generate(target.model, proposer, ids, max_new_tokens=MAX_NEW, draft_steps=k, layer_ids=LAYER_IDS)


def batched(target, proposer, prompts, k, prefill=None):
    return speculative_generate_batch(target.model, proposer, prompts, max_new_tokens=MAX_NEW, draft_steps=k,
                                      layer_ids=LAYER_IDS, prefill=prefill)


@pytest.mark.parametrize("which", ["trained", "untrained"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_the_drafter_decodes_every_row_as_it_decodes_alone(which, k, request, tiny_target, prompts):
    drafter = request.getfixturevalue(f"{which}_drafter")
    rows = batched(tiny_target, BatchDrafterProposer(drafter), prompts, k)
    for ids, row in zip(prompts, rows):
        alone = single(tiny_target, DrafterProposer(drafter), ids, k)
        assert (row.tokens, row.accepted) == (alone.tokens, alone.accepted)
    if which == "trained":
        assert any(a > 1 for row in rows for a in row.accepted)  # drafts were taken, so rejection paths ran too


def test_rows_equal_greedy_generate_and_leave_the_batch_at_their_own_end(monkeypatch, trained_drafter, tiny_target,
                                                                          prompts, eval_messages):
    rows = batched(tiny_target, BatchDrafterProposer(trained_drafter), prompts, 3)
    messages = [*eval_messages, *demo_messages()[:4]]
    assert [row.tokens for row in rows] == [greedy_reply(tiny_target, m, MAX_NEW) for m in messages]
    # One more end-of-sequence token, one the first reply emits early: rows now end at different passes.
    config = tiny_target.model.generation_config
    stop = rows[0].tokens[6]
    monkeypatch.setattr(config, "eos_token_id", sorted({*([config.eos_token_id] if isinstance(config.eos_token_id, int)
                                                         else config.eos_token_id), stop}))
    ending = batched(tiny_target, BatchDrafterProposer(trained_drafter), prompts, 3)
    assert len(ending[0].tokens) <= 7 and len({len(row.tokens) for row in ending}) > 1
    for ids, row in zip(prompts, ending):
        alone = single(tiny_target, DrafterProposer(trained_drafter), ids, 3)
        assert (row.tokens, row.accepted) == (alone.tokens, alone.accepted)


@pytest.mark.parametrize("k", [2, 5])
def test_lookup_and_no_drafter_rows_match_their_single_decodes(k, tiny_target, prompts):
    lookup = batched(tiny_target, RowProposers([LookupProposer(p[0], min_n=1, max_n=3) for p in prompts]), prompts, k)
    plain = batched(tiny_target, RowProposers([NoProposer() for _ in prompts]), prompts, k)
    for ids, row, none in zip(prompts, lookup, plain):
        alone = single(tiny_target, LookupProposer(ids[0], min_n=1, max_n=3), ids, k)
        assert (row.tokens, row.accepted) == (alone.tokens, alone.accepted)
        assert none.tokens == alone.tokens and set(none.accepted) == {1}
    # Lookup proposes fewer than k, or nothing, on some passes: rows of one block carried different lengths.
    assert any(1 < a < k + 1 for row in lookup for a in row.accepted) or any(a == 1 for row in lookup for a in row.accepted)


def test_an_oracle_row_is_accepted_in_full_beside_rows_that_are_not(tiny_target, prompts, eval_messages):
    messages = [*eval_messages, *demo_messages()[:4]]
    references = [greedy_reply(tiny_target, m, MAX_NEW) for m in messages]
    oracle = OracleProposer(prompts[0] + references[0])
    others = [NoProposer() for _ in prompts[1:]]
    rows = batched(tiny_target, RowProposers([oracle, *others]), prompts, 4)
    assert rows[0].tokens == references[0] and rows[0].accepted[:-1] == [5] * (rows[0].steps - 1)
    assert all(row.tokens == ref and set(row.accepted) == {1} for row, ref in zip(rows[1:], references[1:]))


def test_one_prefill_serves_every_decode_of_the_set(trained_drafter, tiny_target, prompts):
    pre = prefill_batch(tiny_target.model, prompts, LAYER_IDS)
    first = batched(tiny_target, BatchDrafterProposer(trained_drafter), prompts, 3, prefill=pre)
    again = batched(tiny_target, BatchDrafterProposer(trained_drafter), prompts, 3, prefill=pre)
    fresh = batched(tiny_target, BatchDrafterProposer(trained_drafter), prompts, 3)
    assert [(r.tokens, r.accepted) for r in first] == [(r.tokens, r.accepted) for r in again] \
        == [(r.tokens, r.accepted) for r in fresh]


def test_a_proposal_longer_than_k_is_refused(tiny_target, prompts):
    class Overeager(NoProposer):
        def propose(self, k: int) -> list[int]:
            return [0] * (k + 1)

    with pytest.raises(ValueError, match="RowProposers proposed 5 tokens, more than the 4"):
        batched(tiny_target, RowProposers([Overeager() for _ in prompts]), prompts, 4)
