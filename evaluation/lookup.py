"""Prompt lookup (n-gram) drafting: the baseline that needs no trained model, as vLLM's ``ngram`` method.

The proposal after a context (prompt + tokens generated so far) is found by matching the context's
suffix against its earlier tokens: the longest suffix n-gram with ``min_n <= n <= max_n`` that also
occurs earlier, and of its earlier occurrences the first one (vLLM's tie-break). The proposal is the
up to ``k`` tokens that follow that occurrence (fewer where the context ends sooner); nothing is
proposed when no suffix of at least ``min_n`` tokens recurs. An occurrence may overlap the suffix
itself, so a repeated token run keeps proposing itself.
"""

from __future__ import annotations

import torch


def lookup_proposal(context: list[int], k: int, *, min_n: int, max_n: int) -> list[int]:
    """The up to ``k`` tokens after the first earlier occurrence of the longest recurring suffix n-gram."""
    total = len(context)
    for n in range(min(max_n, total - 1), min_n - 1, -1):  # an earlier occurrence needs n + 1 tokens at least
        suffix = context[total - n :]  # its earlier occurrences start at 0 .. total-n-1
        start = first_occurrence(context, suffix, end=total - n)
        if start is not None:
            return context[start + n : start + n + k]
    return []


def first_occurrence(context: list[int], pattern: list[int], *, end: int) -> int | None:
    """The first start in ``0 .. end-1`` where ``pattern`` occurs in ``context``; ``list.index`` finds the
    candidates at C speed, so a long context costs little where its first token is rare."""
    start = 0
    while True:
        try:
            start = context.index(pattern[0], start, end)
        except ValueError:
            return None
        if context[start : start + len(pattern)] == pattern:
            return start
        start += 1


class LookupProposer:
    """A ``Proposer`` over the token context alone; the target's hidden states go unused."""

    def __init__(self, first_token: int, *, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"lookup n-gram bounds must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        # ``extend`` hands over the token after each verified position, so never the prompt's first.
        self.context, self.min_n, self.max_n = [first_token], min_n, max_n

    def extend(self, aux: torch.Tensor, next_tokens: list[int]) -> None:
        self.context.extend(next_tokens)

    def propose(self, k: int) -> list[int]:
        return lookup_proposal(self.context, k, min_n=self.min_n, max_n=self.max_n)


class NoProposer:
    """Plain greedy decoding through the same loop: one target pass per token."""

    def extend(self, aux: torch.Tensor, next_tokens: list[int]) -> None:
        pass

    def propose(self, k: int) -> list[int]:
        return []
