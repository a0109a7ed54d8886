"""Which CUDA attention kernels the services' PyTorch runs: not cuDNN's.

PyTorch's ``scaled_dot_product_attention`` picks cuDNN's kernel on recent GPUs (H100, H200) and cuDNN
builds an execution plan for every new sequence length, on the host, a few milliseconds per layer. The
services' shapes change all the time: a decode step's key length grows by one, every verification pass
of speculative decoding adds a block, every hidden-state group has its own width. Measured on an H200
with a 30-layer target (bench/RESULTS.md): a 256-row decode step took 70 ms on lengths cuDNN had not met,
28 ms when the same lengths came again, and 25 ms either way without cuDNN. Flash and memory-efficient
attention need no plan, so they stay on.

torch is imported only when called: ``shared`` stays importable without it.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def avoid_cudnn_attention(device_type: str) -> None:
    """On CUDA, turn cuDNN attention off for this process (a process-wide switch; idempotent)."""
    if device_type != "cuda":
        return
    import torch

    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("cuDNN attention off: it re-plans for every new sequence length; flash / memory-efficient kernels run")
