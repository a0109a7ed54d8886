"""cuDNN attention is switched off for CUDA work and left alone otherwise (the switch is process-wide)."""

from __future__ import annotations

import pytest
import torch

from shared.attention_kernels import avoid_cudnn_attention


@pytest.fixture
def cudnn_restored():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_cuda_work_turns_cudnn_attention_off_and_cpu_work_leaves_it(cudnn_restored):
    torch.backends.cuda.enable_cudnn_sdp(True)
    avoid_cudnn_attention("cpu")
    assert torch.backends.cuda.cudnn_sdp_enabled()
    avoid_cudnn_attention("cuda")
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    avoid_cudnn_attention("cuda")  # a second service start in the same process changes nothing
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
