"""fp8 hidden states (``extraction.storage = "fp8"``): e4m3 values with one bf16 scale per token and layer, by the
rule ``shared.eagle3`` states. Both writers quantize here (the built-in server's ``/hidden_states`` and the
extractor reading vLLM's files), so either writes the same bytes for the same states; the trainer dequantizes."""

from __future__ import annotations

import torch

from shared import eagle3


def quantize_fp8(states: torch.Tensor, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``states`` (..., layers·H) as e4m3 (..., layers·H) and their bf16 scales (..., layers): each token's
    largest magnitude in each layer over FP8_MAX, so that value is e4m3's largest finite one. Each token is
    scaled on its own, so a padded batch quantizes to the same rows as each sample alone."""
    *lead, width = states.shape
    grouped = states.reshape(*lead, layers, width // layers).float()  # (..., layers, H)
    # The floor keeps an all-zero row's scale positive (its values stay 0); bf16 halves the scales' bytes,
    # and dividing by the rounded scale keeps the largest value within the clamp, so it still lands on 448.
    tiny = torch.finfo(torch.float32).tiny
    scale = (grouped.abs().amax(dim=-1) / eagle3.FP8_MAX).clamp_min(tiny).to(torch.bfloat16)  # (..., layers)
    scaled = (grouped / scale.float().unsqueeze(-1)).clamp_(-eagle3.FP8_MAX, eagle3.FP8_MAX)  # (..., layers, H)
    return scaled.to(torch.float8_e4m3fn).reshape(*lead, width), scale


def dequantize_fp8(states: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 ``states`` (..., layers·H) times their ``scale`` (..., layers), in float32: exact, since a
    4-bit by 8-bit significand product fits float32's 24 bits."""
    grouped = states.float().unflatten(-1, (scale.shape[-1], -1))  # (..., layers, H)
    return (grouped * scale.float().unsqueeze(-1)).flatten(-2)  # (..., layers·H)
