"""The verification passes' grouped attention (evaluation/verify_attention.py): equal to transformers' SDPA up to
float rounding, taken for every short pass and never for a prefill, and a decode through it emits exactly the
tokens (and accepts exactly the drafts) a decode through SDPA does."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from transformers.integrations import sdpa_attention

from evaluation.lookup import LookupProposer, NoProposer
from evaluation.speculative_batch import RowProposers, speculative_generate_batch
from evaluation.verify_attention import MAX_GROUPED_QUERIES, grouped_attention, use_grouped_attention
from tests.support.tiny_runs import LAYER_IDS, demo_messages, prompt_ids


def random_pass(queries: int, *, batch: int = 3, heads: int = 6, kv_heads: int = 2, columns: int = 21, dim: int = 8):
    g = torch.Generator().manual_seed(queries)
    q = torch.randn(batch, heads, queries, dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, columns, dim, generator=g) for _ in range(2))
    mask = torch.rand(batch, 1, queries, columns, generator=g) > 0.4
    mask[..., 0] = True  # every query sees at least one column, as every real one sees its own row's tokens
    return q, k, v, mask


def attention_module() -> torch.nn.Module:
    module = torch.nn.Module()
    module.num_key_value_groups = 3  # what transformers' SDPA path reads to repeat the 2 KV heads to 6
    return module


@pytest.mark.parametrize("queries", [1, 4, MAX_GROUPED_QUERIES])
def test_grouped_attention_equals_sdpa_on_a_masked_grouped_pass(queries):
    q, k, v, mask = random_pass(queries)
    module = attention_module()
    ours, _ = grouped_attention(module, q, k, v, mask, scaling=0.3)
    theirs, _ = sdpa_attention.sdpa_attention_forward(module, q, k, v, mask, scaling=0.3, is_causal=False)
    assert ours.shape == theirs.shape == (3, queries, 6, 8)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_values_narrower_than_keys_as_multi_head_latent_attention_has_them():
    q, k, v, mask = random_pass(4, dim=12)
    v = v[..., :8].contiguous()  # DeepSeek-V3 / Kimi-K2: 192-wide queries and keys, 128-wide values
    ours, _ = grouped_attention(attention_module(), q, k, v, mask, scaling=0.3)
    theirs, _ = sdpa_attention.sdpa_attention_forward(attention_module(), q, k, v, mask, scaling=0.3, is_causal=False)
    assert ours.shape == (3, 4, 6, 8)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_a_long_pass_goes_to_sdpa_unchanged():
    q, k, v, mask = random_pass(MAX_GROUPED_QUERIES + 1)
    with mock.patch.object(sdpa_attention, "sdpa_attention_forward", wraps=sdpa_attention.sdpa_attention_forward) as sdpa:
        grouped_attention(attention_module(), q, k, v, mask, scaling=0.3)
        grouped_attention(attention_module(), q[:, :, :1], k, v, None, scaling=0.3)  # no mask: SDPA's causal path
    assert sdpa.call_count == 2


@pytest.fixture(scope="module")
def prompts(tiny_target, eval_messages) -> list[list[int]]:
    return [prompt_ids(tiny_target, m) for m in [*eval_messages, *demo_messages()[:4]]]


def decode(model, prompts, proposer, k):
    results = speculative_generate_batch(model, proposer, prompts, max_new_tokens=40, draft_steps=k, layer_ids=LAYER_IDS)
    return [(r.tokens, r.accepted, r.matched) for r in results]


def test_decodes_through_grouped_attention_equal_decodes_through_sdpa(tiny_target, prompts):
    grouped = copy.deepcopy(tiny_target.model)
    assert use_grouped_attention(grouped) is True
    layers = grouped.config.num_hidden_layers
    for k, proposer in ((0, lambda: RowProposers([NoProposer() for _ in prompts])),
                        (3, lambda: RowProposers([LookupProposer(p[0], min_n=1, max_n=3) for p in prompts]))):
        with mock.patch.object(sdpa_attention, "sdpa_attention_forward",
                               wraps=sdpa_attention.sdpa_attention_forward) as sdpa:
            ours = decode(grouped, prompts, proposer(), k)
        assert sdpa.call_count == layers  # the prefill alone: every verification pass took the grouped products
        assert ours == decode(tiny_target.model, prompts, proposer(), k)
    assert any(accepted > 1 for _, steps, _ in ours for accepted in steps)  # lookup's drafts were accepted too


def test_only_sdpa_is_replaced(tiny_target, caplog):
    eager = copy.deepcopy(tiny_target.model)
    eager.set_attn_implementation("eager")  # as a model with attention sinks loads: its attention stays
    assert use_grouped_attention(eager) is False and eager.config._attn_implementation == "eager"
    plain = torch.nn.Linear(2, 2)
    plain.config = SimpleNamespace(_attn_implementation="sdpa")  # says SDPA, yet takes no attention backend
    with caplog.at_level(logging.INFO):
        assert use_grouped_attention(plain) is False
    assert "keeps its own attention" in caplog.text
