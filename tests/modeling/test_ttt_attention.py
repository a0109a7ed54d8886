"""The block-sparse (flex) form of the TTT chain attention against the dense reference, on the CPU.

Flex attention has no CPU backward, so the forward is compared here; tests/gpu/test_trainer_cuda.py holds
the gradients to the dense form on CUDA, where training uses the flex form.
"""

from __future__ import annotations

import pytest
import torch

from modeling.eagle3 import TTTCache
from modeling.ttt_attention import AUTO, DENSE, FLEX, attention_kind, chain_block_mask


def chain_outputs(flex: bool, q_steps, k_steps, v_steps) -> list[torch.Tensor]:
    cache = TTTCache(flex=flex)
    return [cache.attend(q, k, v) for q, k, v in zip(q_steps, k_steps, v_steps)]


@pytest.mark.parametrize("length, heads, kv_heads", [(200, 4, 2), (37, 2, 2), (128, 6, 3)])
def test_the_flex_chain_attention_equals_the_dense_one_at_every_step(length, heads, kv_heads):
    """Lengths around the 128-token blocks (200 crosses a block inside each step's keys), grouped and plain
    heads, four steps: every step's output equal to the dense form's."""
    torch.manual_seed(0)
    steps, b, hd = 4, 2, 16
    q = [torch.randn(b, heads, length, hd) for _ in range(steps)]
    k = [torch.randn(b, kv_heads, length, hd) for _ in range(steps)]
    v = [torch.randn(b, kv_heads, length, hd) for _ in range(steps)]
    with torch.no_grad():
        dense, flex = chain_outputs(False, q, k, v), chain_outputs(True, q, k, v)
    for step, (want, got) in enumerate(zip(dense, flex)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=lambda m: f"step {step}: {m}")


def test_a_chain_step_attends_to_exactly_the_prefix_and_its_own_chain():
    """Values that mark their origin: a query at index t with equal scores everywhere averages the values
    it sees, so the output names the set: step 0's values at indices <= t and each chain step's at t."""
    length, steps = 5, 3
    q = [torch.zeros(1, 1, length, 4) for _ in range(steps)]  # zero queries: uniform weights over what is seen
    k = [torch.zeros(1, 1, length, 4) for _ in range(steps)]
    v = [torch.full((1, 1, length, 4), 0.0) for _ in range(steps)]
    v[0] = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1).expand(1, 1, length, 4).clone()  # index
    v[1] = torch.full((1, 1, length, 4), 100.0)
    v[2] = torch.full((1, 1, length, 4), 1000.0)
    with torch.no_grad():
        out = chain_outputs(True, q, k, v)[2][0, 0, :, 0]
    for t in range(length):
        seen = [*range(t + 1), 100.0, 1000.0]  # step 0 at 0..t, step 1 at t, step 2 at t
        assert out[t].item() == pytest.approx(sum(seen) / len(seen), rel=1e-5)


def test_block_masks_are_made_once_per_length_and_step():
    chain_block_mask.cache_clear()
    first = chain_block_mask(300, 3, "cpu")
    assert chain_block_mask(300, 3, "cpu") is first
    assert chain_block_mask(300, 4, "cpu") is not first
    assert chain_block_mask.cache_info().misses == 2


def test_auto_picks_flex_on_cuda_and_dense_elsewhere():
    assert attention_kind(AUTO, torch.device("cpu")) == DENSE
    assert attention_kind(AUTO, torch.device("cuda", 0)) == FLEX
    assert attention_kind(FLEX, torch.device("cpu")) == FLEX  # asked for: a CPU run then fails in its backward
    with pytest.raises(ValueError, match="unknown TTT attention 'sparse'"):
        attention_kind("sparse", torch.device("cpu"))
