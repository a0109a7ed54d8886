"""The two target tensors the drafter needs: ``embed_tokens`` and ``lm_head``, read straight from the
model directory's safetensors (one file, or shards listed in ``model.safetensors.index.json``).

Nothing else of the target is built: Kimi-K2 has a trillion parameters, its embedding and head are two
(V, H) matrices.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from shared.errors import CheckpointFormatError

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Checked in order; the suffix search below covers other wrappers.
EMBED_NAMES = ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")


@dataclass(frozen=True)
class TargetHead:
    embed: torch.Tensor  # (V, H)
    lm_head: torch.Tensor  # (V, H)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return target_logits(self.lm_head, hidden)

    def to(self, device: torch.device) -> TargetHead:
        return TargetHead(self.embed.to(device), self.lm_head.to(device))


def target_logits(lm_head: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits from its final-norm hidden state: (..., H) -> (..., V) float32, multiplied in
    the head's dtype so a bf16 head of a large vocabulary is never copied to float32."""
    return (hidden.to(lm_head.dtype) @ lm_head.T).float()


def read_target_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: missing; the target directory needs its config.json")
    return json.loads(path.read_text(encoding="utf-8"))


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config (multimodal targets nest it under ``text_config``)."""
    return config.get("text_config") or config


def weight_map(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        mapping = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {name: model_dir / file for name, file in mapping.items()}
    files = [model_dir / SINGLE_FILE] if (model_dir / SINGLE_FILE).is_file() else sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointFormatError(f"{model_dir}: no safetensors weights (and no {INDEX_FILE})")
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            names.update({name: file for name in handle.keys()})
    return names


def find_tensor(names: dict[str, Path], preferred: tuple[str, ...], suffix: str) -> str | None:
    for name in preferred:
        if name in names:
            return name
    matches = [name for name in names if name.endswith(suffix)]
    if len(matches) > 1:
        raise CheckpointFormatError(f"several tensors end in {suffix!r}: {sorted(matches)[:4]}")
    return matches[0] if matches else None


def read_tensor(path: Path, name: str, dtype: torch.dtype | None) -> torch.Tensor:
    with safe_open(path, framework="pt") as handle:
        tensor = handle.get_tensor(name)
    return tensor if dtype is None else tensor.to(dtype)


def load_target_head(model_dir: Path, dtype: torch.dtype | None = torch.float32) -> TargetHead:
    """Load ``embed_tokens`` and ``lm_head`` (the embedding itself when the target ties them)."""
    config = text_config(read_target_config(model_dir))
    names = weight_map(model_dir)
    embed_name = find_tensor(names, EMBED_NAMES, "embed_tokens.weight")
    if embed_name is None:
        raise CheckpointFormatError(f"{model_dir}: no embed_tokens weight among {len(names)} tensors")
    embed = read_tensor(names[embed_name], embed_name, dtype)
    head_name = find_tensor(names, LM_HEAD_NAMES, "lm_head.weight")
    tied = bool(config.get("tie_word_embeddings", False))
    if head_name is None and not tied:
        raise CheckpointFormatError(f"{model_dir}: no lm_head weight and tie_word_embeddings is false")
    head = embed if tied else read_tensor(names[head_name], head_name, dtype)
    if head.shape != embed.shape:
        raise CheckpointFormatError(f"{model_dir}: lm_head {tuple(head.shape)} and embedding {tuple(embed.shape)} differ")
    log.info("target head from %s: vocab %d, hidden %d, tied=%s", model_dir, embed.shape[0], embed.shape[1], tied)
    return TargetHead(embed=embed, lm_head=head)
