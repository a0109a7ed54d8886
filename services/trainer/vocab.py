"""The draft vocabulary: the target tokens the drafter most often has to predict.

Counts come from loss-masked positions (the tokens the drafter learns) over the training files. The
mapping is stored as EAGLE3.md describes: ``d2t`` int64 [Vd] offsets with target id = i + d2t[i], and
``t2d`` bool [V] marking the target ids that have a draft id. Draft ids follow ascending target ids.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from shared import eagle3
from shared.errors import MaskTokenUnavailable

log = logging.getLogger(__name__)


def count_tokens(files: Iterable[Path], vocab_size: int, max_length: int | None = None) -> torch.Tensor:
    """How often each target id appears at a loss-masked position among each file's first ``max_length``
    rows (the ones training reads; all when None): int64 [V]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for path in files:
        with safe_open(path, framework="pt") as handle:  # reads only the two small tensors
            ids = handle.get_slice(eagle3.INPUT_IDS)[:max_length]
            mask = handle.get_slice(eagle3.LOSS_MASK)[:max_length].bool()
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def build_mapping(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` for the ``min(draft_vocab_size, V)`` most frequent ids; ties go to the lower id so
    the mapping is deterministic, and ids never seen fill the remainder in id order."""
    vocab = counts.shape[0]
    size = min(int(draft_vocab_size), vocab)
    # Stable sort on -count keeps ascending id order among equal counts.
    order = torch.sort(-counts, stable=True).indices
    chosen = torch.sort(order[:size]).values  # target ids, ascending
    d2t = chosen - torch.arange(size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    covered = counts[chosen].sum().item() / max(counts.sum().item(), 1)
    log.info("draft vocabulary: %d of %d target ids, covering %.1f%% of masked tokens", size, vocab, 100 * covered)
    return d2t, t2d


def draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of every draft id: [Vd] int64."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t


def unused_token(files: Iterable[Path], vocab_size: int, max_length: int | None = None) -> int:
    """The highest target id that no position of the files' first ``max_length`` rows holds: a mask token that
    never is a real token of this data (DFlash's mask slots). MaskTokenUnavailable when every id occurs."""
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    for path in files:
        with safe_open(path, framework="pt") as handle:
            ids = handle.get_slice(eagle3.INPUT_IDS)[:max_length]
        seen[ids[ids < vocab_size]] = True
    free = (~seen).nonzero().flatten()
    if free.numel() == 0:
        raise MaskTokenUnavailable(f"every one of the {vocab_size} target ids occurs in the training files: set "
                                   "train.dflash.mask_token_id")
    return int(free[-1])
