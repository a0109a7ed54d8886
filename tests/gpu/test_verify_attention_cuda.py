"""The verification passes' grouped attention on the GPU, where evaluation uses it: equal to SDPA's masked
kernel at SmolLM2's head layout, and switched on by evaluation's target loader on CUDA (not on a CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations import sdpa_attention

from services.trainer.evaluation.evaluate import load_target
from services.trainer.evaluation.verify_attention import NAME, grouped_attention
from services.trainer.train import avoid_cudnn_attention

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("queries", [1, 4, 8])
def test_grouped_attention_equals_sdpa_on_cuda(queries):
    avoid_cudnn_attention()
    g = torch.Generator(device="cuda").manual_seed(queries)
    q = torch.randn(64, 9, queries, 64, device="cuda", generator=g)
    k, v = (torch.randn(64, 3, 700, 64, device="cuda", generator=g) for _ in range(2))
    mask = torch.rand(64, 1, queries, 700, device="cuda", generator=g) > 0.3
    mask[..., 0] = True
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    ours, _ = grouped_attention(module, q, k, v, mask, scaling=0.125)
    theirs, _ = sdpa_attention.sdpa_attention_forward(module, q, k, v, mask, scaling=0.125, is_causal=False)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_evaluation_loads_its_cuda_target_with_grouped_attention(tiny_model_dir):
    cuda, _ = load_target(tiny_model_dir, torch.device("cuda"))
    cpu, _ = load_target(tiny_model_dir, torch.device("cpu"))
    assert cuda.config._attn_implementation == NAME
    assert cpu.config._attn_implementation == "sdpa"
