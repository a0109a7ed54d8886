"""What a draft step's predictions are trained to minimise, summed over the positions a step counts.

Per position the drafter's logits ``z`` over the draft vocabulary meet the target's distribution ``p`` over it
(the target's softmax restricted to the draft vocabulary and renormalised, ``objective.Targets.probs``) and
``m``, the target's own probability mass on the draft vocabulary (``Targets.draft_mass``, 1 when every token
the target could pick has a draft id).

- ``kl`` (the default): the soft cross-entropy ``ce = -sum_i p_i log softmax(z)_i``. With ``sum_i p_i = 1``
  that is ``logsumexp(z) - sum_i p_i z_i``; its gradient is ``softmax(z) - p``. It is KL(p || q) plus the
  target's entropy, which the drafter does not move, so it trains as KL does.
- LK losses (Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for Speculative Decoding",
  arXiv 2602.23881) train the chance that the target accepts the drafted token. Under rejection sampling a
  drafter ``q`` (which drafts only draft-vocabulary tokens) is accepted with probability
  ``alpha = sum_{i in draft vocab} min(m p_i, q_i)``: the target's true probabilities ``m p_i``, not the
  renormalised ones, since the target mass outside the draft vocabulary is lost whatever the drafter does.
  ``lk_lambda``, the hybrid: ``lam ce + (1 - lam)(1 - alpha)`` with ``lam = exp(-eta alpha)`` per position,
  ``alpha`` held constant in ``lam``: where the drafter is far off (small ``alpha``), the cross-entropy's
  strong gradient leads; as it aligns, ``1 - alpha`` (the total variation) takes over. ``lk_alpha``:
  ``-log alpha``, whose gradient is the total variation's scaled by ``1 / alpha``; at a one-hot target it is
  the cross-entropy.

Each is a per-position quantity summed over the masked positions, so a step's sum over the global batch is
the sum of every process's sums, and N processes train like one (train.py divides by the global count).
``lam`` is per position for the same reason: a weight from the batch's mean acceptance would need the other
processes' positions before any loss could be summed.

Memory: written with autograd's own ops, each of the seven steps keeps float32 copies of its (B, T, Vd)
log-probs, of the shifted target distribution and of the product for the backward: at T = 2,048 and a
32,000-token draft vocabulary about 0.8 GB a step, 5.5 GB for the unroll. The functions here keep the logits in
the dtype they come in (bf16 under autocast, 0.13 GB a step), the target distribution as the caller's view (no
copy) and a number or two per position, and recompute the softmax in the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modeling.fused import ce_backward, ce_forward

KL, LK_LAMBDA, LK_ALPHA = "kl", "lk_lambda", "lk_alpha"
LOSSES = (KL, LK_LAMBDA, LK_ALPHA)
DEFAULT_LK_ETA = 3.0  # the paper's setting, and vLLM speculators' default (--lk-loss-eta)
ALPHA_FLOOR = 1e-6  # lk_alpha takes -log(max(alpha, floor)): finite where a drafter has no overlap at all


class UnknownLoss(ValueError):
    """A loss name that is not one of ``LOSSES``."""


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
    return weighted_soft_cross_entropy(logits, probs, mask.to(torch.float32))


def weighted_soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``sum over positions of weight x soft cross-entropy``, weight (...) float32 (0 where a position does not
    count); otherwise as ``soft_cross_entropy``."""
    return _SoftCrossEntropy.apply(logits, probs, weight)


class _Acceptance(torch.autograd.Function):
    # alpha = sum_i min(a_i, q_i), a = m p, q = softmax(z). Where q_i < a_i the minimum is q_i, so
    # d alpha / d z_j = q_j (below_j - S), S = sum_i below_i q_i (a subgradient: a tie counts as not below).
    # The backward recomputes q from the logits rather than keeping a float32 (..., Vd) copy.
    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        q = logits.float().softmax(-1)  # (..., Vd)
        ctx.save_for_backward(logits, probs, mass)
        return torch.minimum(q, probs * mass.unsqueeze(-1)).sum(-1)  # (...)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, probs, mass = ctx.saved_tensors
        q = logits.float().softmax(-1)  # (..., Vd)
        below = q < probs * mass.unsqueeze(-1)  # (..., Vd): where min(a, q) is q
        held = (q * below).sum(-1, keepdim=True)  # (..., 1): S
        dz = q * (below.to(q.dtype) - held) * grad.unsqueeze(-1)
        return dz.to(logits.dtype), None, None


def acceptance(logits: torch.Tensor, probs: torch.Tensor, mass: torch.Tensor | None = None) -> torch.Tensor:
    """The chance, per position, that the target accepts a token drawn from ``softmax(logits)`` under rejection
    sampling: ``sum_i min(mass x probs_i, softmax(logits)_i)``. logits (..., Vd) of any float dtype with their
    graph, probs (..., Vd) float32 softmax rows over the draft vocabulary, mass (...) the target's probability on
    the draft vocabulary (None: 1). Returns (...) float32; the gradient flows to ``logits`` only."""
    if mass is None:
        mass = torch.ones(probs.shape[:-1], dtype=probs.dtype, device=probs.device)
    return _Acceptance.apply(logits, probs, mass)


@dataclass(frozen=True)
class StepLoss:
    """Which loss a step sums over its masked positions (``train.loss``), and LK-lambda's ``eta``
    (``train.lk_eta``)."""

    kind: str = KL
    eta: float = DEFAULT_LK_ETA

    def __post_init__(self) -> None:
        if self.kind not in LOSSES:
            raise UnknownLoss(f"loss {self.kind!r} is not one of {list(LOSSES)}")
        if not self.eta > 0:
            raise ValueError(f"lk_eta {self.eta} must be positive")

    def masked_sum(self, logits: torch.Tensor, probs: torch.Tensor, mass: torch.Tensor | None,
                   mask: torch.Tensor) -> torch.Tensor:
        """The loss summed over the masked positions: logits (..., Vd), probs (..., Vd), mass (...) or None,
        mask (...) bool. A float32 scalar with its graph to ``logits``."""
        if self.kind == KL:
            return soft_cross_entropy(logits, probs, mask)
        weight = mask.to(torch.float32)
        alpha = acceptance(logits, probs, mass)  # (...)
        if self.kind == LK_ALPHA:
            return (-alpha.clamp(min=ALPHA_FLOOR).log() * weight).sum()
        lam = torch.exp(-self.eta * alpha.detach())  # (...): held constant, it only sets the blend
        return weighted_soft_cross_entropy(logits, probs, lam * weight) + ((1 - lam) * (1 - alpha) * weight).sum()
