"""The step losses with their own backward against the plain autograd forms: the soft cross-entropy, and the
LK losses on the target's acceptance (values by hand, masking, sums over split batches, what they train)."""

from __future__ import annotations

import math

import pytest
import torch

from modeling.losses import ALPHA_FLOOR, DEFAULT_LK_ETA, StepLoss, UnknownLoss, acceptance, soft_cross_entropy


def plain(logits: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (-(probs * logits.float().log_softmax(-1)).sum(-1) * mask).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_and_gradients_equal_the_plain_form(dtype):
    torch.manual_seed(0)
    logits = (4 * torch.randn(3, 7, 50)).to(dtype).requires_grad_(True)
    probs = torch.randn(3, 7, 50).softmax(-1).requires_grad_(True)
    mask = torch.rand(3, 7) > 0.3
    ours = soft_cross_entropy(logits, probs, mask)
    ours_logits, ours_probs = torch.autograd.grad(ours, [logits, probs])
    reference = plain(logits, probs, mask)
    ref_logits, ref_probs = torch.autograd.grad(reference, [logits, probs])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(ours, reference, **tol)
    torch.testing.assert_close(ours_logits, ref_logits, **tol)
    torch.testing.assert_close(ours_probs, ref_probs, **tol)
    assert ours_logits.dtype == dtype
    # Masked-out positions get no gradient at all.
    assert ours_logits[~mask].abs().sum() == 0 and ours_probs[~mask].abs().sum() == 0


def test_empty_positions_give_zero_and_a_zero_gradient():
    logits = torch.randn(1, 0, 9, requires_grad=True)
    loss = soft_cross_entropy(logits, torch.zeros(1, 0, 9), torch.zeros(1, 0, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0 and logits.grad.shape == (1, 0, 9)


# ---- the acceptance losses ---------------------------------------------------------------------------

def plain_acceptance(logits: torch.Tensor, probs: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    return torch.minimum(logits.float().softmax(-1), probs * mass[..., None]).sum(-1)


def plain_loss(kind: str, logits, probs, mass, mask, eta: float = DEFAULT_LK_ETA) -> torch.Tensor:
    """Each loss written with autograd's own ops, the form ``StepLoss`` must equal."""
    ce = -(probs * logits.float().log_softmax(-1)).sum(-1)
    alpha = plain_acceptance(logits, probs, mass)
    per_position = {
        "kl": ce,
        "lk_alpha": -alpha.clamp(min=ALPHA_FLOOR).log(),
        "lk_lambda": torch.exp(-eta * alpha.detach()) * ce + (1 - torch.exp(-eta * alpha.detach())) * (1 - alpha),
    }[kind]
    return (per_position * mask).sum()


def test_acceptance_is_the_overlap_with_the_targets_true_probabilities_on_hand_computed_values():
    q = torch.tensor([[0.5, 0.3, 0.2]])  # the drafter's distribution, given as its log
    p = torch.tensor([[0.2, 0.2, 0.6]])  # the target's over the draft vocabulary, renormalised
    assert acceptance(q.log(), p).item() == pytest.approx(0.2 + 0.2 + 0.2)
    # Half the target's mass lies outside the draft vocabulary: its true probabilities are 0.1, 0.1, 0.3.
    assert acceptance(q.log(), p, torch.tensor([0.5])).item() == pytest.approx(0.1 + 0.1 + 0.2)
    assert acceptance(p.log(), p).item() == pytest.approx(1.0)  # a drafter equal to the target is always accepted


def test_each_loss_on_a_hand_computed_position():
    q, p = torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[0.2, 0.2, 0.6]])
    mask = torch.tensor([True])
    ce = -(0.2 * math.log(0.5) + 0.2 * math.log(0.3) + 0.6 * math.log(0.2))
    alpha, lam = 0.6, math.exp(-2.0 * 0.6)
    assert StepLoss("kl").masked_sum(q.log(), p, None, mask).item() == pytest.approx(ce)
    assert StepLoss("lk_alpha").masked_sum(q.log(), p, None, mask).item() == pytest.approx(-math.log(alpha))
    lk = StepLoss("lk_lambda", eta=2.0).masked_sum(q.log(), p, None, mask).item()
    assert lk == pytest.approx(lam * ce + (1 - lam) * (1 - alpha))


def test_lk_alpha_is_the_cross_entropy_where_the_target_is_certain():
    logits, one_hot = torch.randn(4, 6), torch.eye(6)[[1, 3, 0, 5]]
    mask = torch.ones(4, dtype=torch.bool)
    torch.testing.assert_close(StepLoss("lk_alpha").masked_sum(logits, one_hot, None, mask),
                               StepLoss("kl").masked_sum(logits, one_hot, None, mask))


@pytest.mark.parametrize("kind", ["kl", "lk_lambda", "lk_alpha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_and_gradient_of_each_loss_equal_the_plain_form(kind, dtype):
    torch.manual_seed(1)
    logits = (3 * torch.randn(3, 7, 50)).to(dtype).requires_grad_(True)
    probs = (2 * torch.randn(3, 7, 50)).softmax(-1)
    mass = torch.rand(3, 7) * 0.5 + 0.5
    mask = torch.rand(3, 7) > 0.3
    ours = StepLoss(kind, eta=2.5).masked_sum(logits, probs, mass, mask)
    (ours_grad,) = torch.autograd.grad(ours, logits)
    reference = plain_loss(kind, logits, probs, mass, mask, eta=2.5)
    (ref_grad,) = torch.autograd.grad(reference, logits)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(ours, reference, **tol)
    torch.testing.assert_close(ours_grad, ref_grad, **tol)
    assert ours_grad.dtype == dtype and ours_grad[~mask].abs().sum() == 0  # masked-out positions learn nothing


@pytest.mark.parametrize("kind", ["lk_lambda", "lk_alpha"])
def test_a_masked_position_without_any_overlap_adds_nothing_and_stays_finite(kind):
    # Position 1's target puts all its mass where the drafter puts none: acceptance 0, -log 0 = inf.
    logits = torch.tensor([[0.0, 0.0, 0.0], [80.0, -80.0, -80.0]], requires_grad=True)
    probs = torch.tensor([[0.2, 0.3, 0.5], [0.0, 0.0, 1.0]])
    mask = torch.tensor([True, False])
    loss = StepLoss(kind).masked_sum(logits, probs, None, mask)
    loss.backward()
    alone = StepLoss(kind).masked_sum(logits[:1].detach(), probs[:1], None, mask[:1])
    assert loss.item() == pytest.approx(alone.item()) and torch.isfinite(logits.grad).all()
    assert logits.grad[1].abs().sum() == 0


@pytest.mark.parametrize("kind", ["kl", "lk_lambda", "lk_alpha"])
def test_two_half_batches_summed_equal_the_whole_batch(kind):
    # What lets N processes train like one: each rank's sum, added up, is the one process's sum.
    torch.manual_seed(2)
    logits = torch.randn(4, 9, 30, requires_grad=True)
    probs, mass, mask = (2 * torch.randn(4, 9, 30)).softmax(-1), torch.rand(4, 9), torch.rand(4, 9) > 0.4
    loss = StepLoss(kind)
    whole = loss.masked_sum(logits, probs, mass, mask)
    (whole_grad,) = torch.autograd.grad(whole, logits)
    halves = [loss.masked_sum(logits[rows], probs[rows], mass[rows], mask[rows]) for rows in (slice(0, 1), slice(1, 4))]
    (halves_grad,) = torch.autograd.grad(halves[0] + halves[1], logits)
    torch.testing.assert_close(halves[0] + halves[1], whole)
    torch.testing.assert_close(halves_grad, whole_grad)


def toy_capacity(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A target distribution over 8 tokens and a drafter that can only move its logits along 2 fixed
    directions: too little capacity to match the target, the regime where KL and acceptance part."""
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(8, generator=g)).softmax(-1), torch.randn(2, 8, generator=g)


def trained_acceptance(kind: str, target: torch.Tensor, directions: torch.Tensor, steps: int = 400) -> float:
    theta = torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.Adam([theta], lr=0.05)
    loss, mask = StepLoss(kind), torch.ones(1, dtype=torch.bool)
    for _ in range(steps):
        optimizer.zero_grad()
        loss.masked_sum((theta @ directions)[None], target[None], None, mask).backward()
        optimizer.step()
    with torch.no_grad():
        return acceptance((theta @ directions)[None], target[None]).item()


@pytest.mark.parametrize("seed", [4, 9])
def test_an_lk_loss_trains_a_drafter_of_limited_capacity_to_a_higher_acceptance_than_kl(seed):
    target, directions = toy_capacity(seed)
    start = acceptance(torch.zeros(1, 8), target[None]).item()
    by_kl = trained_acceptance("kl", target, directions)
    for kind in ("lk_lambda", "lk_alpha"):
        by_lk = trained_acceptance(kind, target, directions)
        assert by_lk > start and by_lk > by_kl + 0.05, kind


def test_an_unknown_loss_is_refused_by_name():
    with pytest.raises(UnknownLoss, match="'tv'"):
        StepLoss("tv")
