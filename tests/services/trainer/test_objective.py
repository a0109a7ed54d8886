"""The TTT objective as training computes it (label views, the losses' own backward, targets in chunks)
against its plain form: the shifted copies and autograd's log-softmax it replaced; for every ``train.loss``,
and split over batches as the processes of a run split it."""

from __future__ import annotations

import pytest
import torch

from services.trainer import objective as objective_module
from services.trainer.data import Batch
from modeling.eagle3 import shift
from services.trainer.objective import Targets, TTTObjective, make_targets
from modeling.losses import StepLoss
from services.trainer.vocab import draft_to_target
from tests.modeling.test_eagle3 import SMALL, random_drafter
from tests.modeling.test_losses import plain_loss

LOSSES = ["kl", "lk_lambda", "lk_alpha"]


def plain_targets(batch: Batch, lm_head: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor) -> Targets:
    logits = (batch.last_hidden.to(lm_head.dtype) @ lm_head.T).float()  # (B, L, V) at once
    argmax, columns = logits.argmax(-1), draft_to_target(d2t)
    return Targets(logits[..., columns].softmax(-1), argmax, t2d[argmax], logits.softmax(-1)[..., columns].sum(-1))


def plain_objective(objective: TTTObjective, batch: Batch, targets: Targets) -> tuple[torch.Tensor, torch.Tensor]:
    d, loss_sums, counts = objective.drafter, [], []
    for k, hidden in enumerate(objective.unroll(batch.input_ids, batch.aux_hidden)):
        logits = d.logits(hidden)  # (B, L, Vd)
        learned = shift(batch.loss_mask, k + 2)
        mask = learned & shift(targets.in_draft, k + 1)
        loss_sums.append(plain_loss(objective.loss.kind, logits, shift(targets.probs, k + 1),
                                    shift(targets.draft_mass, k + 1), mask, eta=objective.loss.eta))
        hit = d.to_target_ids(logits.argmax(-1)) == shift(targets.argmax, k + 1)
        counts.append(torch.stack([mask.sum(), (hit & learned).sum(), learned.sum()]))
    return torch.stack(loss_sums), torch.stack(counts, dim=1).float()


def padded_batch(lengths: list[int], seed: int = 1) -> Batch:
    """Rows of the given lengths, right-padded as ``collate`` pads them; random states and a mask of ones
    after a 'prompt' of a third of each row."""
    g = torch.Generator().manual_seed(seed)
    width, b = max(lengths), len(lengths)
    ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.bool)
    aux = torch.zeros(b, width, 3 * SMALL.target_hidden_size)
    last = torch.zeros(b, width, SMALL.hidden_size)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(0, SMALL.vocab_size, (n,), generator=g)
        mask[row, n // 3 : n] = True
        aux[row, :n] = torch.randn(n, aux.shape[-1], generator=g)
        last[row, :n] = torch.randn(n, last.shape[-1], generator=g)
    return Batch(ids, mask, aux, last, torch.tensor(lengths))


@pytest.fixture()
def setup():
    drafter = random_drafter(seed=4).train()
    g = torch.Generator().manual_seed(2)
    drafter.set_vocab_mapping(*mapping(g))
    lm_head = torch.randn(SMALL.vocab_size, SMALL.hidden_size, generator=g)
    return drafter, lm_head


def mapping(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft vocabulary of SMALL.draft_vocab_size random target ids, so some labels fall outside it."""
    chosen = torch.randperm(SMALL.vocab_size, generator=g)[: SMALL.draft_vocab_size].sort().values
    t2d = torch.zeros(SMALL.vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return chosen - torch.arange(SMALL.draft_vocab_size), t2d


def test_targets_in_chunks_equal_the_whole_product(setup, monkeypatch):
    drafter, lm_head = setup
    batch = padded_batch([13, 9, 4])
    whole = plain_targets(batch, lm_head, drafter.d2t, drafter.t2d)
    monkeypatch.setattr(objective_module, "TARGET_CHUNK", 5)  # chunks that cut rows of the batch apart
    chunked = make_targets(batch, lm_head, drafter.d2t, drafter.t2d)
    torch.testing.assert_close(chunked.probs, whole.probs)
    torch.testing.assert_close(chunked.draft_mass, whole.draft_mass)
    assert torch.equal(chunked.argmax, whole.argmax) and torch.equal(chunked.in_draft, whole.in_draft)
    assert not whole.in_draft.all() and whole.in_draft.any()  # both kinds of label occur


def test_draft_mass_is_the_targets_probability_on_the_draft_vocabulary(setup):
    drafter, lm_head = setup
    batch = padded_batch([13, 9])
    mass = make_targets(batch, lm_head, drafter.d2t, drafter.t2d).draft_mass  # (B, L)
    assert ((mass > 0) & (mass < 1)).all()  # 40 of 60 ids have a draft id: part of the mass lies outside
    every_id = torch.zeros(SMALL.vocab_size, dtype=torch.long), torch.ones(SMALL.vocab_size, dtype=torch.bool)
    whole_vocabulary = make_targets(batch, lm_head, *every_id).draft_mass
    torch.testing.assert_close(whole_vocabulary, torch.ones_like(whole_vocabulary))


@pytest.mark.parametrize("kind", LOSSES)
@pytest.mark.parametrize("lengths", [[21], [21, 14, 3]])
def test_losses_counts_and_gradients_equal_the_plain_objective(setup, lengths, kind):
    """Same weights, same padded batch (a row shorter than the unroll included): the per-step loss sums,
    the counts and every trainable parameter's gradient equal the plain form's, for every train.loss."""
    drafter, lm_head = setup
    batch = padded_batch(lengths)
    targets = make_targets(batch, lm_head, drafter.d2t, drafter.t2d)
    objective = TTTObjective(drafter, 7, loss=StepLoss(kind, eta=2.0))
    results = []
    for compute in (objective.forward, lambda b, t: plain_objective(objective, b, t)):
        drafter.zero_grad(set_to_none=True)
        ce_sums, counts = compute(batch, targets)
        (ce_sums * 0.8 ** torch.arange(7)).sum().backward()
        results.append((ce_sums.detach(), counts, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}))
    (ce, counts, grads), (ref_ce, ref_counts, ref_grads) = results
    torch.testing.assert_close(ce, ref_ce, atol=1e-5, rtol=1e-5)
    assert torch.equal(counts, ref_counts) and counts[0].sum() > 0
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def rows_of(batch: Batch, rows: slice) -> Batch:
    """The batch a process holding only these rows trains: the rows, padded to their own longest."""
    width = int(batch.lengths[rows].max())
    return Batch(batch.input_ids[rows, :width], batch.loss_mask[rows, :width], batch.aux_hidden[rows, :width],
                 batch.last_hidden[rows, :width], batch.lengths[rows])


@pytest.mark.parametrize("kind", LOSSES)
def test_the_sums_of_two_half_batches_are_the_whole_batchs(setup, kind):
    """Two processes each holding part of a global batch: their loss sums, counts and gradients add up to
    what one process computes over all of it, so train.py's division by the global count is the mean."""
    drafter, lm_head = setup
    batch = padded_batch([21, 14, 3, 17], seed=5)
    objective = TTTObjective(drafter, 5, loss=StepLoss(kind))

    def sums(part: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        drafter.zero_grad(set_to_none=True)
        loss_sums, counts = objective(part, make_targets(part, lm_head, drafter.d2t, drafter.t2d))
        loss_sums.sum().backward()
        return loss_sums.detach(), counts, drafter.fc.weight.grad.clone()

    whole = sums(batch)
    halves = [sums(rows_of(batch, rows)) for rows in (slice(0, 1), slice(1, 4))]
    torch.testing.assert_close(halves[0][0] + halves[1][0], whole[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(halves[0][1] + halves[1][1], whole[1])
    torch.testing.assert_close(halves[0][2] + halves[1][2], whole[2], atol=1e-5, rtol=1e-4)


def test_the_default_loss_is_the_soft_cross_entropy_unchanged(setup):
    drafter, lm_head = setup
    batch = padded_batch([21, 14])
    targets = make_targets(batch, lm_head, drafter.d2t, drafter.t2d)
    default, kl = TTTObjective(drafter, 3)(batch, targets), TTTObjective(drafter, 3, loss=StepLoss("kl"))(batch, targets)
    assert torch.equal(default[0], kl[0]) and torch.equal(default[1], kl[1])
    without_mass = Targets(targets.probs, targets.argmax, targets.in_draft)  # the cross-entropy never reads it
    assert torch.equal(TTTObjective(drafter, 3)(batch, without_mass)[0], default[0])
