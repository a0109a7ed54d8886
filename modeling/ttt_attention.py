"""The attention of a training-time-test step k >= 1 as one block-sparse flex-attention call.

Step k's query at index t sees step 0's keys at indices <= t and the keys of steps 1..k at index t only
(``model.TTTCache``). Written densely that is a (B, nh, T, T) score matrix per step, masked, concatenated
with k diagonal columns and soft-maxed in float32: at T = 2,048 on Llama-3.1-8B drafter shapes about a
third of a training step's time and most of its attention memory (bench/RESULTS.md, the trainer profile).

Here the keys and values of steps 0..k are laid side by side, ``[K_0 | K_1 | ... | K_k]`` (length (k+1)T),
and one flex-attention call computes the same softmax over exactly the allowed keys: causal over the
first T columns, the diagonal of every later block of T. The block mask tells the kernel which 128 x 128
tiles hold any allowed key, so the diagonal blocks cost T/128 tiles each and nothing of the (T, kT)
matrix is materialized; the backward keeps one log-sum-exp per query instead of the weights.

Flex attention is fast only compiled (``torch.compile`` generates its Triton kernels) and has no CPU
backward, so ``attention_kind`` picks it on CUDA and the dense form elsewhere; both compute the same
function (tests/services/trainer/test_ttt_attention.py on CPU, tests/gpu for the gradients).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from modeling.fused import compile_dynamic

log = logging.getLogger(__name__)

AUTO = "auto"  # flex on CUDA, dense elsewhere
DENSE = "dense"
FLEX = "flex"
ATTENTION_KINDS = (AUTO, DENSE, FLEX)
MASK_CACHE = 128  # block masks kept, one per (length, steps): batches of a run share a few hundred lengths


def attention_kind(requested: str, device: torch.device) -> str:
    """The attention a run uses on ``device``: ``auto`` resolves to flex on CUDA, dense on the CPU."""
    if requested not in ATTENTION_KINDS:
        raise ValueError(f"unknown TTT attention {requested!r}, expected one of {ATTENTION_KINDS}")
    if requested == AUTO:
        return FLEX if device.type == "cuda" else DENSE
    return requested


def chain_mask(length: int) -> Callable[..., torch.Tensor]:
    """The allowed (query, key) pairs over ``[K_0 | K_1 | ...]`` blocks of ``length`` keys each."""

    def allowed(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        step, index = kv_idx // length, kv_idx % length
        return ((step == 0) & (index <= q_idx)) | ((step > 0) & (index == q_idx))

    return allowed


@functools.lru_cache(maxsize=MASK_CACHE)
def chain_block_mask(length: int, steps: int, device: str) -> Any:
    """The block mask of a step that sees ``steps`` blocks (step 0 and ``steps - 1`` chain steps)."""
    from torch.nn.attention.flex_attention import create_block_mask

    on_gpu = torch.device(device).type == "cuda"
    return create_block_mask(chain_mask(length), None, None, length, length * steps, device=device, _compile=on_gpu)


@functools.cache
def _flex(compiled: bool) -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    log.info("compiling flex attention for the TTT chain (once per process)")
    return compile_dynamic(flex_attention)


def chain_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                    chain: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Step ``len(chain)``'s attention output (B, nh, T, hd): ``q`` (B, nh, T, hd) over step 0's keys and
    values (B, nkv, T, hd) and the chain's, as ``TTTCache`` defines it."""
    length = q.shape[2]
    keys = torch.cat([k0, *(k for k, _ in chain)], dim=2)  # (B, nkv, (k+1)T, hd)
    values = torch.cat([v0, *(v for _, v in chain)], dim=2)
    mask = chain_block_mask(length, len(chain) + 1, str(q.device))
    flex = _flex(q.device.type == "cuda")
    return flex(q, keys, values, block_mask=mask, enable_gqa=q.shape[1] != k0.shape[1])
