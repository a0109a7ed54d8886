"""Batches of prompts of unequal length, as the target takes them."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask``, both (B, T) with T the longest prompt: each prompt ends at the right
    edge, so every row's next token is decoded at the same position."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)
