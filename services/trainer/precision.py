"""Which weights a training step computes with, and which the optimizer updates.

``fp32``: float32 weights, updated in place; on CUDA the step runs under bf16 autocast, which casts each
weight to a bf16 copy per step and each float32 activation a matmul reads to another, and casts their
gradients back (at Llama-3.1-8B drafter shapes 7.6 ms of a 92 ms step at 2,048 tokens, 13.4 of 154 at
4,096; bench/RESULTS.md).

``bf16``: the step computes with bf16 weights and bf16 gradients, and the optimizer updates float32 master
copies of them, copied back to the bf16 weights after each update (as SpecForge's BF16Optimizer does). The
forward is the autocast one's (autocast rounds every matmul's weight to bf16 anyway); the norm weights
and the seven TTT uses' gradient sums round to bf16 too. It saves the weights' casts and the autocast weight
cache, but copies each gradient into its master and each master back after the update: measured at those
shapes, 0.11-0.22 GiB less memory and 1-6% slower (bench/RESULTS.md), so it is an option for memory and
``fp32`` the default.

Checkpoints hold the float32 masters (``full_precision``), so a resumed run continues from exactly the
weights it stopped at, and the finished drafter carries them (``finish``): evaluation and the export see
the same weights in either mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from shared.errors import DraftlineError

FP32, BF16 = "fp32", "bf16"
PRECISIONS = (FP32, BF16)


class UnsupportedPrecision(DraftlineError):
    """The run's train.precision cannot train as the run is set up."""


def precision_kind(requested: str, world: int = 1) -> str:
    """The run's precision, checked (a RunSpec already holds one of these; other callers may not).

    bf16 trains in one process only: over two gloo processes its gradient norm came out twice the
    one-process figure on a step whose second rank held only a stand-in sample, and 4% off on a full step,
    where float32 weights match to rounding. Until that is understood such a run stops before training."""
    if requested not in PRECISIONS:
        raise ValueError(f"unknown train.precision {requested!r}, expected one of {PRECISIONS}")
    if requested == BF16 and world > 1:
        raise UnsupportedPrecision(f"train.precision bf16 trains in one process only, this run has {world} "
                                   "(DRAFTLINE_TRAIN_PROCS); set train.precision to fp32 to train in several")
    return requested


class Float32Weights:
    """The optimizer updates the weights the step computes with."""

    compute_dtype: torch.dtype | None = None  # the step's inputs keep their dtype (autocast casts on CUDA)

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params

    @property
    def optimizer_params(self) -> list[nn.Parameter]:
        return self.params

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Before backward, after the forward: every gradient the step will write starts empty. (Under DDP the
        forward may rebuild its gradient buckets, which keeps the gradients that still exist as bucket views;
        clearing them only after it, as for float32 weights, leaves DDP's reduced gradients where they are read.)"""
        optimizer.zero_grad(set_to_none=True)

    def grads_to_optimizer(self) -> list[nn.Parameter]:
        """After backward: the tensors holding the gradients the optimizer steps with (clip these)."""
        return self.params

    def after_update(self) -> None:
        """After the optimizer step."""

    @contextmanager
    def full_precision(self) -> Iterator[None]:
        """The weights as checkpoints save and load them, for the duration."""
        yield

    def finish(self) -> None:
        """Leave the float32 weights in the model (the end of training)."""


class MasterWeights(Float32Weights):
    """bf16 weights for the step; float32 masters that the optimizer updates."""

    compute_dtype = torch.bfloat16

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params)
        self.masters = [nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in params]
        self.low = [p.data.to(self.compute_dtype) for p in params]
        for p, low in zip(params, self.low):
            p.data = low

    @property
    def optimizer_params(self) -> list[nn.Parameter]:
        return self.masters

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        super().zero_grad(optimizer)
        for p in self.params:
            p.grad = None

    def grads_to_optimizer(self) -> list[nn.Parameter]:
        for p, master in zip(self.params, self.masters):
            master.grad = None if p.grad is None else p.grad.to(torch.float32)
        return self.masters

    def after_update(self) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self.low, [m.data for m in self.masters])

    @contextmanager
    def full_precision(self) -> Iterator[None]:
        # The parameters hold the masters' tensors for the duration, so a save reads them and a load writes them.
        for p, master in zip(self.params, self.masters):
            p.data = master.data
        try:
            yield
        finally:
            for p, low in zip(self.params, self.low):
                p.data = low
            self.after_update()

    def finish(self) -> None:
        for p, master in zip(self.params, self.masters):
            p.data = master.data


def make_weights(drafter: nn.Module, kind: str) -> Float32Weights:
    """The run's weights: ``drafter``'s trainable parameters must be float32 (as the drafter is built)."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    return MasterWeights(params) if kind == BF16 else Float32Weights(params)
