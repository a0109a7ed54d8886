"""The data order: which samples form each global batch of an epoch, and each rank's share of it.

A plan is a pure function of the samples' lengths (from the verified file headers, so no tensor is
read), the run's seed, the epoch and the batching settings. Every rank computes the same plan, and a
resumed run computes the plan it was interrupted in and skips the batches it had taken.

Two orders:

- ``shuffle``: the epoch's shuffle cut into global batches of ``batch_size x world`` (the order of
  runs whose checkpoints predate length grouping, which resume with it).
- ``length`` (the default): the shuffle cut into windows of ``WINDOW_BATCHES`` global batches; inside a
  window samples are sorted by length, longest first, and cut into global batches, so a batch pads to
  a length close to each of its samples'. The batches are then shuffled (so the epoch does not walk
  through windows from long to short), and the batch that computes the most tokens goes first: a batch
  that does not fit the GPU fails at step 1, not hours into the run. Each sample is in exactly one
  batch per epoch, as with ``shuffle``.

With ``max_tokens`` a global batch holds as many samples as keep each rank's share within that many
padded tokens (share size x its longest sample), at least one sample per rank; ``batch_size`` is then
not used. Without it a global batch holds ``batch_size x world`` samples, the last one of an epoch
fewer.

A global batch goes to ranks by stride (rank r takes samples r, r + world, ...); a batch shorter than
the world leaves some ranks a stand-in sample (``Share.filler``) that runs but adds no loss, because
every rank must join each step's all-reduces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SHUFFLE = "shuffle"
LENGTH = "length"
BATCHINGS = (SHUFFLE, LENGTH)
WINDOW_BATCHES = 64  # global batches per sorting window: larger pads less, smaller mixes more across epochs


@dataclass(frozen=True)
class Share:
    """One rank's part of one global batch."""

    indices: list[int]  # sample indices into the run's file list
    filler: bool  # a stand-in: the batch has no sample for this rank


@dataclass(frozen=True)
class Padding:
    """Tokens of real samples against the positions the drafter runs over (every rank's padded share)."""

    real: int
    computed: int

    @property
    def fraction(self) -> float:
        """Share of the computed positions that are padding (or stand-in samples): 0 when none are."""
        return 1.0 - self.real / self.computed if self.computed else 0.0

    def __add__(self, other: Padding) -> Padding:
        return Padding(self.real + other.real, self.computed + other.computed)


def _generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch)


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The epoch's shuffle: the same on every rank and after every resume."""
    return torch.randperm(n, generator=_generator(seed, epoch)).tolist()


def fixed_batches(order: list[int], span: int) -> list[list[int]]:
    return [order[start : start + span] for start in range(0, len(order), span)]


def budget_batches(ranked: list[int], lengths: list[int], *, max_tokens: int, world: int,
                   max_samples: int | None = None) -> list[list[int]]:
    """Cut samples sorted longest first into global batches whose per-rank share (ceil(size / world)
    samples padded to the batch's first, longest, sample) stays within ``max_tokens``, and of at most
    ``max_samples`` samples where that is set."""
    batches: list[list[int]] = []
    for index in ranked:
        batch = batches[-1] if batches else None
        fits = batch is not None and (max_samples is None or len(batch) < max_samples) and (
            len(batch) < world or math.ceil((len(batch) + 1) / world) * lengths[batch[0]] <= max_tokens)
        if fits:
            batch.append(index)
        else:
            batches.append([index])
    return batches


def plan_epoch(lengths: list[int], *, seed: int, epoch: int, batch_size: int, world: int,
               max_tokens: int | None = None, batching: str = LENGTH, cap_tokens: int | None = None) -> list[list[int]]:
    """The epoch's global batches in training order, as the module doc describes. ``cap_tokens`` bounds a global
    batch's padded tokens on top of its size (an online run's budget must hold two batches' files: online.py);
    the sorting windows stay those of the uncapped plan, so a cap no batch reaches changes nothing."""
    if batching not in BATCHINGS:
        raise ValueError(f"unknown batching {batching!r}, expected one of {BATCHINGS}")
    generator = _generator(seed, epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()  # epoch_order's draw
    if batching == SHUFFLE:
        return fixed_batches(order, batch_size * world)
    per_batch = batch_size * world if max_tokens is None else max(world, max_tokens * world // max(1, _mean(lengths)))
    window = WINDOW_BATCHES * per_batch
    rank_cap = None if cap_tokens is None else max(1, cap_tokens // world)  # budget_batches bounds each rank's share
    if rank_cap is not None and max_tokens is not None:
        max_tokens, rank_cap = min(max_tokens, rank_cap), None
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        # sorted() is stable: equal lengths keep the shuffle's order, so ties are random but reproducible
        ranked = sorted(order[start : start + window], key=lambda i: -lengths[i])
        if max_tokens is None and rank_cap is None:
            batches += fixed_batches(ranked, batch_size * world)
        elif max_tokens is None:
            batches += budget_batches(ranked, lengths, max_tokens=rank_cap, world=world, max_samples=batch_size * world)
        else:
            batches += budget_batches(ranked, lengths, max_tokens=max_tokens, world=world)
    batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    costs = [batch_padding(b, lengths, world).computed for b in batches]
    first = costs.index(max(costs))
    return [batches[first], *batches[:first], *batches[first + 1 :]]


def _mean(lengths: list[int]) -> int:
    return sum(lengths) // len(lengths) if lengths else 1


def share(batch: list[int], rank: int, world: int) -> Share:
    """This rank's part of a global batch: every ``world``-th sample from ``rank`` on, or a stand-in."""
    mine = batch[rank::world]
    return Share(mine, False) if mine else Share(batch[:1], True)


def batch_padding(batch: list[int], lengths: list[int], world: int) -> Padding:
    """Real and computed tokens of one global batch over all ranks (a stand-in computes, adds nothing real)."""
    real = sum(lengths[i] for i in batch)
    computed = 0
    for rank in range(world):
        part = share(batch, rank, world)
        computed += len(part.indices) * max(lengths[i] for i in part.indices)
    return Padding(real, computed)


def plan_padding(batches: list[list[int]], lengths: list[int], world: int) -> Padding:
    total = Padding(0, 0)
    for batch in batches:
        total = total + batch_padding(batch, lengths, world)
    return total
