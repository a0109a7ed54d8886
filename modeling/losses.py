"""The soft cross-entropy of a TTT step, with a backward that keeps only the drafter's logits.

Per position: ``ce = -sum_i p_i log softmax(z)_i``, the drafter's logits ``z`` against the target's
distribution ``p`` over the draft vocabulary. With ``sum_i p_i = 1`` (``p`` is a softmax) that is
``logsumexp(z) - sum_i p_i z_i``, and its gradient is ``softmax(z) - p``.

Written with autograd's own ops, each of the seven steps keeps float32 copies of its (B, T, Vd) log-probs,
of the shifted target distribution and of the product for the backward: at T = 2,048 and a 32,000-token
draft vocabulary about 0.8 GB a step, 5.5 GB for the unroll. This function keeps the logits in the dtype
they come in (bf16 under autocast, 0.13 GB a step), the target distribution as the caller's view (no
copy) and one log-sum-exp per position, and recomputes the softmax in the backward.
"""

from __future__ import annotations

import torch

from modeling.fused import ce_backward, ce_forward


class _SoftCrossEntropy(torch.autograd.Function):
    # ``lse * sum(p) - p.z`` is ``-p.log_softmax(z)`` for any ``p``, so value and gradients are the plain
    # form's exactly, a test's gradient with respect to ``p`` included. Both passes are fused kernels on
    # CUDA (``fused.ce_forward``, ``fused.ce_backward``).
    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        total, lse, mass = ce_forward(logits, probs, weight)
        ctx.save_for_backward(logits, probs, lse, mass, weight)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        logits, probs, lse, mass, weight = ctx.saved_tensors
        scale = (grad * weight).unsqueeze(-1)  # (..., 1)
        dz, dprobs = ce_backward(logits, probs, lse, mass, scale, ctx.needs_input_grad[1])
        return dz, dprobs, None


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum over masked positions of -sum_i probs_i log softmax(logits)_i``: logits (..., Vd) of any float
    dtype with their graph, probs (..., Vd) float32 (softmax rows), mask (...) bool.
    Returns a float32 scalar; the gradient flows to ``logits`` (and to ``probs`` where it asks for one)."""
    return _SoftCrossEntropy.apply(logits, probs, mask.to(torch.float32))
