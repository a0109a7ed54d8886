"""The data order: every sample once per epoch, reproducible, split across ranks, and little padding."""

from __future__ import annotations

import random

import pytest

from services.trainer.batching import (
    LENGTH,
    SHUFFLE,
    WINDOW_BATCHES,
    batch_padding,
    epoch_order,
    plan_epoch,
    plan_padding,
    share,
)


def mixed_lengths(n: int = 600, seed: int = 3) -> list[int]:
    """Chat-like lengths: mostly short replies, some long ones, a few at the extraction limit."""
    rng = random.Random(seed)
    return [rng.choice([rng.randint(40, 300), rng.randint(300, 1500), rng.randint(1500, 4096), 4096]) for _ in range(n)]


def flat(plan: list[list[int]]) -> list[int]:
    return sorted(i for batch in plan for i in batch)


PLANS = [
    {"batch_size": 4, "world": 1},
    {"batch_size": 3, "world": 2},
    {"batch_size": 2, "world": 3, "max_tokens": 6000},
    {"batch_size": 1, "world": 1, "max_tokens": 8192},
]


@pytest.mark.parametrize("batching", [SHUFFLE, LENGTH])
@pytest.mark.parametrize("settings", PLANS)
def test_every_sample_is_in_exactly_one_batch_per_epoch_and_the_plan_repeats(settings, batching):
    lengths = mixed_lengths()
    for epoch in range(3):
        plan = plan_epoch(lengths, seed=7, epoch=epoch, batching=batching, **settings)
        assert flat(plan) == list(range(len(lengths)))
        assert plan == plan_epoch(lengths, seed=7, epoch=epoch, batching=batching, **settings)  # what a resume computes
    first, second = (plan_epoch(lengths, seed=7, epoch=e, batching=batching, **settings) for e in (0, 1))
    assert first != second
    assert first != plan_epoch(lengths, seed=8, epoch=0, batching=batching, **settings)


@pytest.mark.parametrize("settings", PLANS)
def test_ranks_take_disjoint_shares_that_make_up_each_global_batch(settings):
    lengths, world = mixed_lengths(), settings["world"]
    for batch in plan_epoch(lengths, seed=1, epoch=0, **settings):
        parts = [share(batch, rank, world) for rank in range(world)]
        real = [i for part in parts if not part.filler for i in part.indices]
        assert sorted(real) == sorted(batch) and len(real) == len(set(real))
        assert all(part.indices for part in parts)  # a stand-in still runs a sample


def test_the_shuffle_order_is_the_order_checkpoints_without_a_batching_name_were_made_with():
    lengths = mixed_lengths(50)
    order = epoch_order(50, 5, 2)
    assert plan_epoch(lengths, seed=5, epoch=2, batch_size=4, world=2, batching=SHUFFLE) == [
        order[i : i + 8] for i in range(0, 50, 8)]


def test_global_batches_do_not_depend_on_how_many_processes_share_them():
    """One process with batch_size 4 and two with batch_size 2 train the same global batches (DDP test)."""
    lengths = mixed_lengths()
    assert plan_epoch(lengths, seed=0, epoch=1, batch_size=4, world=1) == plan_epoch(lengths, seed=0, epoch=1, batch_size=2, world=2)


def test_a_token_budget_bounds_every_ranks_padded_share():
    lengths, budget, world = mixed_lengths(), 6000, 2
    plan = plan_epoch(lengths, seed=0, epoch=0, batch_size=1, world=world, max_tokens=budget)
    for batch in plan:
        for rank in range(world):
            part = share(batch, rank, world).indices
            assert len(part) * max(lengths[i] for i in part) <= budget or len(part) == 1
    sizes = [len(b) for b in plan]
    assert max(sizes) > 10 * min(sizes)  # short samples travel in large batches, long ones in small


def test_the_first_batch_is_the_one_that_computes_the_most_tokens():
    lengths = mixed_lengths()
    plan = plan_epoch(lengths, seed=0, epoch=0, batch_size=4, world=2)
    costs = [batch_padding(batch, lengths, 2).computed for batch in plan]
    assert costs[0] == max(costs)


def test_length_grouping_pads_a_small_fraction_of_what_shuffled_batches_pad():
    lengths = mixed_lengths(n=WINDOW_BATCHES * 8 * 4)
    shuffled = plan_padding(plan_epoch(lengths, seed=0, epoch=0, batch_size=8, world=1, batching=SHUFFLE), lengths, 1)
    grouped = plan_padding(plan_epoch(lengths, seed=0, epoch=0, batch_size=8, world=1), lengths, 1)
    assert shuffled.real == grouped.real == sum(lengths)
    assert shuffled.fraction > 0.4 and grouped.fraction < 0.05, (shuffled.fraction, grouped.fraction)


def test_padding_counts_a_stand_in_sample_as_computed_and_not_real():
    lengths = [10, 4, 7]
    assert batch_padding([0, 1], lengths, 1).computed == 20  # two rows padded to 10
    assert batch_padding([2], lengths, 2).real == 7 and batch_padding([2], lengths, 2).computed == 14
