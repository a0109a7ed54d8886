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
from safetensors.torch import save

from shared.atomic import atomic_write_bytes

from shared import eagle3
from shared.errors import MaskTokenUnavailable

log = logging.getLogger(__name__)


class TokenTally:
    """What the draft vocabulary (and DFlash's mask token) is chosen from: how often each target id is learned, and
    which ids occur at all, over the rows training reads of some files. Files given at construction are read when
    a figure is first asked for (never, where a base checkpoint brings its own mapping); ``add`` reads one now, and
    ``add_ids`` counts a sample from its ids (an online plan counts its replies before any file exists)."""

    def __init__(self, vocab_size: int, max_length: int | None = None, files: Iterable[Path] = ()) -> None:
        self.vocab_size, self.max_length = vocab_size, max_length
        self.pending = list(files)
        self.learned = torch.zeros(vocab_size, dtype=torch.long)
        self.occurring = torch.zeros(vocab_size, dtype=torch.bool)
        self.files = 0

    def add(self, path: Path) -> None:
        with safe_open(path, framework="pt") as handle:  # reads only the two small tensors
            ids = handle.get_slice(eagle3.INPUT_IDS)[: self.max_length]
            mask = handle.get_slice(eagle3.LOSS_MASK)[: self.max_length].bool()
        self.learned += torch.bincount(ids[mask], minlength=self.vocab_size)[: self.vocab_size]
        self.occurring[ids[ids < self.vocab_size]] = True
        self.files += 1

    def add_ids(self, input_ids: list[int], loss_mask: list[int]) -> None:
        """Count one sample from its token ids and loss mask (an online plan's, read from its reply record)."""
        ids = torch.tensor(input_ids[: self.max_length], dtype=torch.long)
        mask = torch.tensor(loss_mask[: self.max_length], dtype=torch.bool)
        self.learned += torch.bincount(ids[mask], minlength=self.vocab_size)[: self.vocab_size]
        self.occurring[ids[ids < self.vocab_size]] = True
        self.files += 1

    def _read_pending(self) -> None:
        while self.pending:
            self.add(self.pending.pop(0))

    @property
    def counts(self) -> torch.Tensor:
        """How often each target id appears at a loss-masked position: int64 [V]."""
        self._read_pending()
        return self.learned

    def unused(self) -> int:
        """The highest target id that no row holds: a mask token that never is a real token of this data
        (DFlash's mask slots). MaskTokenUnavailable when every id occurs."""
        self._read_pending()
        free = (~self.occurring).nonzero().flatten()
        if free.numel() == 0:
            raise MaskTokenUnavailable(f"every one of the {self.vocab_size} target ids occurs in the training files: "
                                       "set train.dflash.mask_token_id")
        return int(free[-1])


    def save(self, path: Path) -> None:
        """The tally as a safetensors file (atomic): what the other ranks of an online run build their draft
        vocabulary from, so every rank's is the same without every rank reading the files."""
        self._read_pending()
        atomic_write_bytes(path, save({"learned": self.learned, "occurring": self.occurring},
                                      metadata={"files": str(self.files)}))

    @classmethod
    def load(cls, path: Path, max_length: int | None = None) -> TokenTally:
        with safe_open(path, framework="pt") as handle:
            learned, occurring = handle.get_tensor("learned"), handle.get_tensor("occurring")
            files = int((handle.metadata() or {}).get("files", 0))
        tally = cls(int(learned.shape[0]), max_length)
        tally.learned, tally.occurring, tally.files = learned, occurring, files
        return tally


def count_tokens(files: Iterable[Path], vocab_size: int, max_length: int | None = None) -> torch.Tensor:
    """How often each target id appears at a loss-masked position among each file's first ``max_length``
    rows (the ones training reads; all when None): int64 [V]."""
    return TokenTally(vocab_size, max_length, files).counts


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
    """The highest target id that no position of the files' first ``max_length`` rows holds (``TokenTally.unused``)."""
    return TokenTally(vocab_size, max_length, files).unused()
