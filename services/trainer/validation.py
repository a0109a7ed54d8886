"""Held-out acceptance while training: the one-pass curve over hidden-state files the drafter never trains on.

``train.validation_files`` holds that many of the run's files out of training, picked by a hash of their
sample id, so every rank and every resume holds out the same ones. At each checkpoint and at the end, rank 0
has the drafter draft at every point of each held-out file's assistant turns (a turn is a reply, everything
before it its prompt) from the states the file stores, and walks each turn as a greedy decode would walk it
(``evaluation.one_pass``): the acceptance length at k = 1 .. ``evaluate.curve_max_steps``.

What it is and is not: the replies are the ones the target wrote in generation (both turns, as long as
generation let them be), and the states are the stored ones (bf16 or fp8), so the figure is not the
evaluation's, which decodes first and second turns apart for ``evaluate.max_new_tokens`` with the target in
float32 after training; on ShareGPT it read 0.4 higher, mostly from longer replies (bench/RESULTS.md). Its
use is the trend: whether the drafter still gets better on conversations it never saw, checkpoint by
checkpoint, while it trains (``validation.jsonl``, and the status page's ``val_accept<k>``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from services.trainer.data import Batch, HiddenStateDataset, collate
from evaluation.one_pass import Counts, Rows, Span, add_drafter
from modeling.eagle3 import TargetTied
from shared.errors import HiddenStateFileError

log = logging.getLogger(__name__)

FILES_PER_BATCH = 8


def validation_split(files: Sequence[tuple[int, Path]], count: int) -> tuple[list[Path], list[Path]]:
    """(training files, validation files), each in sample order: the ``count`` files whose sample ids hash
    lowest are held out (a fixed choice, spread over the dataset whatever its order)."""
    if count and count >= len(files):
        raise HiddenStateFileError(f"train.validation_files {count} leaves none of the run's {len(files)} "
                                   "hidden-state files to train on")
    rank = sorted(files, key=lambda item: hashlib.sha256(str(item[0]).encode()).digest())
    held = {sample_id for sample_id, _ in rank[:count]}
    return ([path for sample_id, path in files if sample_id not in held],
            [path for sample_id, path in files if sample_id in held])


def turn_spans(batch: Batch) -> list[Span]:
    """Every maximal run of loss-masked tokens of every row: the assistant turns the target wrote. A turn
    at index 0 (no prompt before it) loses its first token, which nothing drafts from."""
    spans = []
    for row in range(batch.input_ids.shape[0]):
        mask = batch.loss_mask[row, : int(batch.lengths[row])].tolist()
        ids = batch.input_ids[row].tolist()
        start = None
        for index, learned in enumerate([*mask, False]):
            if learned and start is None:
                start = index
            elif not learned and start is not None:
                first = max(start, 1)
                if index - first > 0:
                    spans.append(Span(row, first, ids[first:index]))
                start = None
    return spans


def file_rows(batch: Batch, layer_ids: Sequence[int]) -> Rows:
    """A batch of files as ``Rows``: their stored auxiliary states split by layer, their turns as spans."""
    layers = torch.chunk(batch.aux_hidden, len(layer_ids), dim=-1)  # (B, L, Ht) each, in the file's layer order
    return Rows(dict(zip(layer_ids, layers)), batch.input_ids, turn_spans(batch))


class Validation:
    """The held-out files and how to measure a drafter on them."""

    def __init__(self, files: list[Path], max_length: int, ks: Sequence[int], device: torch.device) -> None:
        # Read again at each measurement rather than held: 256 held-out files of a Kimi-class target are
        # gigabytes of states, and a few reads per run cost seconds.
        self.dataset = HiddenStateDataset(files, max_length)
        self.ks = sorted(ks)
        self.device = device

    @torch.inference_mode()
    def measure(self, drafter: TargetTied) -> dict[str, Any]:
        """The drafter's one-pass curve over every held-out turn (float32, in eval mode for the duration)."""
        started, training = time.monotonic(), drafter.training
        drafter.eval()
        counts, turns = Counts.empty(self.ks), 0
        try:
            for first in range(0, len(self.dataset), FILES_PER_BATCH):
                batch = collate([self.dataset[i] for i in range(first, min(first + FILES_PER_BATCH, len(self.dataset)))])
                rows = file_rows(batch.to(self.device, drafter.fc.weight.dtype), list(drafter.config.layer_ids))
                turns += len(rows.spans)
                add_drafter(counts, drafter, rows)
        finally:
            drafter.train(training)
        # Every k emits every reply token after a turn's first: the turns' tokens the curve is over.
        return {"files": len(self.dataset), "turns": turns, "tokens": counts.tallies[self.ks[0]].emitted,
                "curve": counts.curve(), "seconds": round(time.monotonic() - started, 2)}
