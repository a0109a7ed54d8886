"""The one-pass acceptance curve against real decoding on the tiny target: in float64, where rounding cannot
turn an argmax, every prompt's passes at every k equal the decoder's, for the EAGLE-3 drafter, a DFlash
drafter and prompt lookup; the walk itself on hand-made cases."""

from __future__ import annotations

import copy

import pytest
import torch

from evaluation.evaluate import greedy_references
from evaluation.lookup import LookupProposer
from evaluation.one_pass import (
    Replay,
    leading_matches,
    lookup_matches,
    one_pass_counts,
    replay_batches,
    walk,
)
from evaluation.speculative_batch import RowProposers, drafter_proposer, speculative_generate_batch
from tests.support.tiny_runs import LAYER_IDS, demo_messages, prompt_ids

MAX_NEW = 40  # some replies end at eos, others at the budget
KS = [1, 2, 3, 5]


def test_walk_counts_passes_as_the_decode_does():
    assert walk([0, 0, 0], 3) == (3, 3)  # nothing accepted: a token a pass
    assert walk([3, 3, 3, 3, 3, 3, 3], 3) == (7, 2)  # k + 1 a pass, the last pass cut at the reply's end
    assert walk([5, 0, 0, 0, 0, 0], 2) == (6, 4)  # at most k accepted; then r_3 .. r_6 one a pass
    assert walk([1, 9, 0, 9], 3) == (4, 3)  # 2 at index 0, 1 at index 2, and at index 3 only the last token is left
    assert walk([], 3) == (0, 0)  # a one-token reply: the prefill's token and no pass


def test_leading_matches_stop_at_the_first_wrong_draft_and_the_reply_end():
    reply = [10, 11, 12, 13]
    assert leading_matches([11, 12, 99], reply, 0) == 2
    assert leading_matches([99, 12], reply, 0) == 0
    assert leading_matches([13, 14, 15], reply, 2) == 1  # nothing past r_3 to match


def test_batches_stay_within_their_token_budget():
    replays = [Replay([1] * n, [2] * 4) for n in (6, 6, 16, 2)]
    assert [len(b) for b in replay_batches(replays, 30)] == [2, 1, 1]
    assert [len(b) for b in replay_batches(replays, 1)] == [1, 1, 1, 1]  # one row at least


@pytest.fixture(scope="module")
def wide(tiny_target):
    """The tiny target in float64."""
    return copy.deepcopy(tiny_target.model).double()


@pytest.fixture(scope="module")
def replays(tiny_target, wide, eval_messages) -> list[Replay]:
    prompts = [prompt_ids(tiny_target, m) for m in [*eval_messages, *demo_messages()[:4]]]
    return [Replay(p, r) for p, r in zip(prompts, greedy_references(wide, prompts, MAX_NEW))]


def decoded_passes(target, proposer_of, replays, k, layer_ids) -> list[tuple[int, int]]:
    rows = speculative_generate_batch(target, proposer_of(), [r.prompt for r in replays], max_new_tokens=MAX_NEW,
                                      draft_steps=k, layer_ids=list(layer_ids))
    for row, r in zip(rows, replays):
        assert row.tokens == r.reply  # the decode is the greedy reply the one-pass walk walks
    return [(sum(row.accepted), row.steps) for row in rows]


def one_pass_passes(target, drafter, replays, k) -> list[tuple[int, int]]:
    found = []
    for r in replays:
        counts = one_pass_counts(target, [r], {"d": drafter}, [k], batch_tokens=1 << 16)["d"]
        found.append((counts.emitted[k], counts.passes[k]))
    return found


@pytest.mark.parametrize("which", ["trained_drafter", pytest.param("trained_dflash", marks=pytest.mark.dflash)])
def test_a_drafters_one_pass_passes_equal_its_decoded_passes_prompt_by_prompt(which, request, wide, replays):
    drafter = copy.deepcopy(request.getfixturevalue(which)).double()
    accepted_more = False
    for k in KS:
        decoded = decoded_passes(wide, lambda: drafter_proposer(drafter), replays, k, drafter.config.layer_ids)
        assert one_pass_passes(wide, drafter, replays, k) == decoded, f"k={k}"
        accepted_more |= any(emitted > passes for emitted, passes in decoded)
    assert accepted_more  # drafts were accepted, so the walk's multi-token steps were compared too


def test_prompt_lookup_one_pass_equals_its_decode(wide, replays):
    for k in KS:
        decoded = decoded_passes(wide, lambda: RowProposers([LookupProposer(r.prompt[0], min_n=1, max_n=3)
                                                             for r in replays]), replays, k, LAYER_IDS)
        from_walk = [walk(lookup_matches(r, max(KS), min_n=1, max_n=3), k) for r in replays]
        assert from_walk == decoded, f"k={k}"
    assert any(e > p for r in replays for e, p in [walk(lookup_matches(r, 3, min_n=1, max_n=3), 3)])


def test_batched_counts_are_the_sum_of_the_prompts_and_every_drafter_shares_one_target_pass(
        trained_drafter, untrained_drafter, tiny_target, wide, replays):
    drafters = {"trained": copy.deepcopy(trained_drafter).double(), "untrained": copy.deepcopy(untrained_drafter).double()}
    together = one_pass_counts(wide, replays, drafters, KS, batch_tokens=1 << 16, lookup=(1, 3))
    for name, drafter in drafters.items():
        for k in KS:
            alone = one_pass_passes(wide, drafter, replays, k)
            assert (together[name].emitted[k], together[name].passes[k]) == tuple(map(sum, zip(*alone)))
    assert together["trained"].curve()["3"] > together["untrained"].curve()["3"]
    assert set(together) == {"trained", "untrained", "lookup"}
    # A small budget cuts the set into one-row batches and the drafters' parts into single rows: same counts.
    small = one_pass_counts(wide, replays, drafters, KS, batch_tokens=1, lookup=(1, 3))
    assert {n: c.curve() for n, c in small.items()} == {n: c.curve() for n, c in together.items()}
    # Each reply's own counts, in reply order for every proposer (a paired margin resamples them): the prompt's
    # alone, and every proposer emits the same reply.
    for k in KS:
        for name, drafter in drafters.items():
            assert together[name].replies[k] == small[name].replies[k] == one_pass_passes(wide, drafter, replays, k)
        assert [e for e, _ in together["lookup"].replies[k]] == [e for e, _ in together["trained"].replies[k]]
        assert len(together["lookup"].replies[k]) == len(replays)


def test_a_reply_with_nothing_to_draft_at_keeps_every_proposers_replies_aligned(trained_drafter, wide, replays):
    drafter = copy.deepcopy(trained_drafter).double()
    with_short = [replays[0], Replay(replays[1].prompt, replays[1].reply[:1]), replays[2]]
    counts = one_pass_counts(wide, with_short, {"d": drafter}, [3], batch_tokens=1 << 16, lookup=(1, 3))
    assert len(counts["d"].replies[3]) == len(counts["lookup"].replies[3]) == 2  # the one-token reply: no pass
    assert [e for e, _ in counts["lookup"].replies[3]] == [e for e, _ in counts["d"].replies[3]]


def test_in_float32_the_curve_is_the_decoded_one_within_rounding(trained_drafter, tiny_target, replays):
    target = tiny_target.model
    references = greedy_references(target, [r.prompt for r in replays], MAX_NEW)
    same = [Replay(r.prompt, ref) for r, ref in zip(replays, references)]
    counts = one_pass_counts(target, same, {"d": trained_drafter}, [3], batch_tokens=1 << 16)["d"]
    decoded = decoded_passes(target, lambda: drafter_proposer(trained_drafter), same, 3, trained_drafter.config.layer_ids)
    emitted, passes = map(sum, zip(*decoded))
    assert counts.emitted[3] == emitted
    assert abs(counts.passes[3] - passes) <= len(same)  # a turned near tie moves a prompt's walk by a pass or so
    assert torch.get_default_dtype() == torch.float32
