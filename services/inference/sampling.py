"""Choose the next token of every row: greedy, or temperature and nucleus (top-p) sampling.

Each sampled row draws from its own ``torch.Generator``, so a seeded request samples the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A private generator for a sampled row (seeded by the request, else at random); none for greedy."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return torch.Generator(device=device).manual_seed(seed)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose probability reaches ``top_p``; keep at least one."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)  # (V,)
    # A token is dropped when the tokens ranked above it already reach top_p.
    before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def next_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Token ids (B,) from float logits (B, V), one row per request."""
    chosen = logits.argmax(dim=-1)  # (B,)
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        probs = torch.softmax(logits[row] / p.temperature, dim=-1)  # (V,)
        probs = top_p_filter(probs, p.top_p)
        chosen[row] = torch.multinomial(probs, 1, generator=gen)[0]
    return chosen
