"""Attention settings a process running a target or a drafter on a GPU needs."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def avoid_cudnn_attention() -> None:
    """Turn cuDNN's attention kernel off for this process (process-wide, idempotent). On H100/H200 PyTorch's
    SDPA picks it, and it builds an execution plan on the host for every new sequence length: each decode
    step (its key length grows by one), each hidden-state group, training batch and verification pass met new
    lengths. Measured on an H200 (bench/RESULTS.md, "Decode step profile"): a 256-row decode step took 70 ms on
    new lengths with it, 25 ms without. Flash and memory-efficient attention need no plan and stay on."""
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("cuDNN attention off: it re-plans for every new sequence length")
