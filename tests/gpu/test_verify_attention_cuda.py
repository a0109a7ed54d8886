"""The verification passes' grouped attention on the GPU, where evaluation uses it: equal to SDPA's masked
kernel at SmolLM2's head layout, and switched on by evaluation's target loader on CUDA (not on a CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations import sdpa_attention

from evaluation.evaluate import load_target
from evaluation.verify_attention import NAME, grouped_attention
from modeling.attention import avoid_cudnn_attention

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


def test_on_cuda_the_one_pass_curve_is_the_decoded_one_within_rounding(tiny_model_dir, trained_drafter, eval_messages):
    """Evaluation on a GPU verifies through the grouped attention and measures the one-pass curve through
    SDPA's prefill: the two forms of the same acceptance, side by side in every report, agree there too."""
    import copy

    from evaluation.evalsets import EvalPrompt
    from evaluation.evaluate import evaluate_prompts
    from shared.runspec import EvalConfig
    from tests.support.tiny_runs import demo_messages

    target, tokenizer = load_target(tiny_model_dir, torch.device("cuda"))
    drafter = copy.deepcopy(trained_drafter).to("cuda")
    prompts = [EvalPrompt(300 + i, m) for i, m in enumerate([*eval_messages, *demo_messages()[:4]])]
    report = evaluate_prompts(target, tokenizer, drafter, prompts, EvalConfig(max_new_tokens=40, draft_steps=3))
    assert report["greedy_check"]["mismatches"] == []
    drafter_ = report["methods"]["drafter"]
    assert drafter_["curve"]["3"] > 1.2  # drafts were accepted
    for k, passes in drafter_["passes"].items():  # a turned near tie moves a prompt's walk by a pass or so
        assert abs(drafter_["one_pass"]["passes"][k] - passes) <= len(prompts), k
