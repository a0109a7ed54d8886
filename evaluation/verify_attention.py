"""The target's attention for verification passes on a GPU: a few new columns per row against a long masked cache.

Profiled on the H200 at SmolLM2-135M's shape, float32, 256 rows of ~500-token prompts (bench/RESULTS.md,
"Where an evaluation pass goes"): a pass spends about half its GPU time in SDPA's memory-efficient kernel, which
parallelises over query blocks and so walks the whole cache serially for the one to eight queries a row brings,
and nearly a third copying the cache's keys and values to every query head, because transformers repeats grouped
KV heads whenever SDPA is handed a mask. Both go when a pass this short is two batched matrix products over the
grouped heads as they are stored: the query heads of one KV head become rows of one product.

Long queries (the prompts' prefill) keep SDPA: there the kernel's parallelism pays, and a dense score matrix of
prompt x cache would not fit. The result equals SDPA's up to float rounding; a pass's greedy tokens are checked
against the target's own greedy decode, made with the same attention, as ever.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

NAME = "draftline_verify"
# Up to this many new columns a row (the verification block of k + 1 <= 16 tokens) take the grouped product.
MAX_GROUPED_QUERIES = 16


def grouped_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query`` (B, Hq, Q, D), ``key``/``value`` (B, Hkv, L, D), the boolean
    mask (B, 1, Q, L) True where a query sees a column; returns (B, Q, Hq, D)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, queries, dim = query.shape
    kv_heads, columns, value_dim = key.shape[1], key.shape[2], value.shape[-1]  # MLA's values are narrower
    if attention_mask is None or queries > MAX_GROUPED_QUERIES or attention_mask.dtype != torch.bool:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    groups = heads // kv_heads  # query head h reads KV head h // groups, as transformers' repeat_kv pairs them
    q = query.reshape(batch, kv_heads, groups * queries, dim)
    scale = scaling if scaling is not None else dim ** -0.5
    scores = torch.matmul(q, key.transpose(-1, -2)).mul_(scale)  # (B, Hkv, G*Q, L)
    scores = scores.view(batch, kv_heads, groups, queries, columns)
    scores.masked_fill_(~attention_mask[:, :, None], torch.finfo(scores.dtype).min)  # mask (B, 1, 1, Q, L)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs.view(batch, kv_heads, groups * queries, columns), value)  # (B, Hkv, G*Q, D)
    return out.view(batch, heads, queries, value_dim).transpose(1, 2).contiguous(), None


def register() -> str:
    """Make ``NAME`` an attention implementation transformers knows, with SDPA's boolean masks; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, grouped_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME


def use_grouped_attention(target: Any) -> bool:
    """Switch a loaded transformers model from SDPA to ``grouped_attention`` for its verification passes. Only
    SDPA is replaced, by the same function: a model loaded with another attention (eager for attention sinks,
    say) needs what that one computes, and keeps it; so does one whose code takes no attention backend (some
    remote code), with a warning. Only speed differs."""
    current = getattr(getattr(target, "config", None), "_attn_implementation", None)
    if current != "sdpa":
        log.info("target %s keeps its %s attention for verification passes", type(target).__name__, current)
        return False
    try:
        target.set_attn_implementation(register())
    except (AttributeError, ValueError) as exc:
        log.warning("target %s keeps its own attention for verification passes: %s", type(target).__name__, exc)
        return False
    return True
