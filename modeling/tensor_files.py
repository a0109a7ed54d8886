"""Tensors to a safetensors file on the volume, atomically: the drafter's export and the trainer's checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save

from shared.atomic import atomic_write_bytes


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """``tensors`` (moved to the CPU, made contiguous) written to ``path`` by temp file, fsync and rename."""
    payload = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    atomic_write_bytes(path, save(payload, metadata=metadata))
