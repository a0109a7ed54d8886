"""The soft cross-entropy with its own backward against the plain autograd form."""

from __future__ import annotations

import pytest
import torch

from modeling.losses import soft_cross_entropy


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
