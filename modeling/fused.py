"""The drafter's elementwise work, compiled into fused kernels where it trains on a GPU.

At Llama-3.1-8B drafter shapes the linear layers of a training step run near the GPU's peak, and most of
the rest was elementwise kernels run one by one, each a pass over memory: RMSNorm's float32 round trip,
RoPE, SiLU times up, the casts between them and the loss's log-sum-exp (bench/RESULTS.md, the trainer
profile). ``torch.compile`` fuses each function below into a kernel or two forward and backward, and its
backward keeps fewer intermediates. The math is the eager code's; each function runs eagerly on the CPU
(the tests' device) and wherever no gradient is asked for (evaluation), so only training on CUDA changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F

RECOMPILE_LIMIT = 64  # dynamic shapes keep one kernel per dtype and grad layout; the limit is a guard

Fn = TypeVar("Fn", bound=Callable[..., object])


def compile_dynamic(fn: Callable[..., object]) -> Callable[..., object]:
    """``torch.compile`` with dynamic shapes (every batch has its own length) and room for the few
    variants each function meets (dtypes, which inputs need a gradient)."""
    from torch._dynamo import config  # imported here: it loads the compiler stack, which a CPU run never needs

    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=True)


def compiled_for_cuda_training(fn: Fn) -> Fn:
    """``fn`` compiled (dynamic shapes, once per process) when its first argument is a CUDA tensor and
    autograd records; ``fn`` itself otherwise."""
    compiled: Callable[..., object] | None = None

    @functools.wraps(fn)
    def call(*args: object) -> object:
        nonlocal compiled
        first = args[0]
        if not (isinstance(first, torch.Tensor) and first.is_cuda and torch.is_grad_enabled()):
            return fn(*args)
        if compiled is None:
            compiled = compile_dynamic(fn)
        return compiled(*args)

    return call  # type: ignore[return-value]


@compiled_for_cuda_training
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    # Normalize in float32 like the serving engines, then scale in the input dtype; the result in ``dtype``.
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype)).to(dtype)


@compiled_for_cuda_training
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (B, n, T, hd)
    return (x * cos + rotated * sin).to(x.dtype)


@compiled_for_cuda_training
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _ce_forward(logits: torch.Tensor, probs: torch.Tensor, weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    z = logits.float()  # (..., Vd)
    lse = torch.logsumexp(z, dim=-1)  # (...)
    mass = probs.sum(-1)  # (...), 1 for a softmax row
    ce = lse * mass - (probs * z).sum(-1)  # (...)
    return (ce * weight).sum(), lse, mass


def _ce_backward(logits: torch.Tensor, probs: torch.Tensor, lse: torch.Tensor, mass: torch.Tensor,
                 scale: torch.Tensor, with_probs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    logp = logits.float() - lse.unsqueeze(-1)  # (..., Vd), recomputed instead of kept
    dz = (logp.exp() * mass.unsqueeze(-1) - probs) * scale  # sum(p) softmax(z) - p, weighted
    return dz.to(logits.dtype), (-logp * scale if with_probs else None)


@functools.cache
def _compiled(fn: Callable[..., object]) -> Callable[..., object]:
    return compile_dynamic(fn)


def ce_forward(logits: torch.Tensor, probs: torch.Tensor, weight: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The soft cross-entropy's forward (``losses``): masked sum, log-sum-exp and target mass per position.
    Runs inside an autograd Function (no grad mode), so it is compiled on CUDA directly."""
    return (_compiled(_ce_forward) if logits.is_cuda else _ce_forward)(logits, probs, weight)


def ce_backward(logits: torch.Tensor, probs: torch.Tensor, lse: torch.Tensor, mass: torch.Tensor,
                scale: torch.Tensor, with_probs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients with respect to the logits and (``with_probs``) to the target distribution."""
    return (_compiled(_ce_backward) if logits.is_cuda else _ce_backward)(logits, probs, lse, mass, scale, with_probs)
