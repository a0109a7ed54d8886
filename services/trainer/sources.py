"""Where a training session's batches come from, behind the one interface the loop uses.

A source knows what a session trains on (its files, their lengths, the epochs and each epoch's global batches,
the draft vocabulary's tally) and hands the loop each step's batch:

- ``batches(epoch, first)``: the epoch's steps from global batch ``first`` on, each this rank's share of it as
  a padded ``Batch``;
- ``after_step(epoch, index)``: the step that read global batch ``index`` is done;
- ``after_checkpoint(position)``: a checkpoint at ``position`` is on the volume;
- ``finish()``: training has ended.

Two sources: ``StoredFiles`` here (offline: every file of the run, verified before training starts, read by a
``DataLoader``) and ``Spool`` (``online_source.py``: an online run's files, asked for in training order within
its byte budget and released after the step that read them). Both plan their epochs from the samples' lengths
with ``epoch_plan``, so one seed, one recipe and one set of lengths give the same batches online and offline.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from services.trainer import checkpoint as ckpt
from services.trainer.batching import BATCHINGS, LENGTH, SHUFFLE, plan_epoch, share
from services.trainer.data import Batch, HiddenStateDataset, collate, list_hidden_files, loss_tokens_beyond, verify_files
from services.trainer.validation import validation_split
from services.trainer.vocab import TokenTally
from shared.errors import CheckpointFormatError
from shared.hidden_file import HiddenFileInfo
from shared.layout import RunPaths
from shared.runspec import RunSpec, TrainConfig

log = logging.getLogger(__name__)

LOADER_WORKERS = 4  # per training process on a GPU: a 2,048-token 8B-shape sample is 66 MB to read and pad
LOADER_PREFETCH = 2  # batches each worker keeps ready

# On SmolLM2-135M (bench/RESULTS.md, 2026-12-02) 6 passes over 1.19M positions beat 4: the acceptance still
# rose with more training there, so an unset ``train.epochs`` trains about that many positions in all. A
# smaller dataset gets more passes, up to a cap that is a guard, not a measurement: a dataset that small
# trains a weak drafter however often it is seen, and the run says so (services.trainer.jobs.too_small_warning).
# A larger one gets fewer, but never one: on ShareGPT (2026-12-05) 3 passes over 2.4M positions beat 2 on every
# held-out set, and 2 passes over 10.7M were still gaining on held-out conversations when the schedule ended,
# where the positions rule alone would have stopped after one.
AUTO_EPOCH_POSITIONS = 7_000_000
MIN_AUTO_EPOCHS = 2
MAX_AUTO_EPOCHS = 10


def auto_epochs(configured: int | None, positions_per_epoch: int) -> int:
    """``train.epochs`` when set; otherwise the passes that train about AUTO_EPOCH_POSITIONS positions, at least
    MIN_AUTO_EPOCHS."""
    if configured is not None:
        return configured
    return max(MIN_AUTO_EPOCHS, min(MAX_AUTO_EPOCHS, math.ceil(AUTO_EPOCH_POSITIONS / max(1, positions_per_epoch))))


def checkpoint_batching(paths: RunPaths, cfg: TrainConfig) -> str:
    """The batch order a run trains in: its latest checkpoint's (a run resumes in the order it started
    in; checkpoints that name none predate length grouping), otherwise the one its settings ask for."""
    found = ckpt.latest_checkpoint(paths.checkpoints_dir)
    if found is None:
        return LENGTH if cfg.group_by_length else SHUFFLE
    batching = ckpt.read_checkpoint_state(found).get("batching", SHUFFLE)
    if batching not in BATCHINGS:
        raise CheckpointFormatError(f"{found}: unknown batching {batching!r}")
    return batching


def epoch_plan(cfg: TrainConfig, lengths: list[int], epoch: int, world: int, batching: str,
               cap_tokens: int | None = None) -> list[list[int]]:
    """The epoch's global batches. With ``global_batch_size`` they are the batches one process would train
    with that batch size, whatever the number of processes, each of which takes its share by stride; so
    the steps, and a checkpoint's data position, mean the same on any number of processes. ``cap_tokens``: an
    online run's bound on a global batch's padded tokens (``batching.plan_epoch``)."""
    if cfg.global_batch_size is not None:
        return plan_epoch(lengths, seed=cfg.seed, epoch=epoch, batch_size=cfg.global_batch_size, world=1,
                          batching=batching, cap_tokens=cap_tokens)
    return plan_epoch(lengths, seed=cfg.seed, epoch=epoch, batch_size=cfg.batch_size, world=world,
                      max_tokens=cfg.max_tokens, batching=batching, cap_tokens=cap_tokens)


@dataclass(frozen=True)
class Reading:
    """Who reads a source, and how the loop wants to hear of a stop while the source waits."""

    rank: int
    world: int
    device: torch.device
    position: ckpt.Position  # where training resumes
    stop: Callable[[], bool] = lambda: False  # a stop was requested (runtime.shutdown, or torchrun's ranks' file)
    checkpoint_now: Callable[[], None] = lambda: None  # rank 0's checkpoint where training stands


@dataclass(frozen=True)
class Step:
    """One step's data: global batch ``index`` of its epoch, and this rank's share of it, padded."""

    index: int
    global_batch: list[int]  # indices into the source's files (failed samples left out online)
    rows: list[int]  # this rank's share of it (a stand-in's where the batch has no sample for this rank)
    batch: Batch  # those rows, padded; a stand-in adds no loss


@dataclass
class Source:
    """What a session trains on (see the module doc for how the loop reads it)."""

    files: list[Path]  # in dataset order: plans index into it
    sample_ids: list[int]  # each file's sample id
    held_out: list[Path]  # the validation files (train.validation_files)
    tally: TokenTally  # what the draft vocabulary is counted from
    lengths: list[int]  # tokens of each file training reads (each file's first train max_length)
    epochs: int
    plans: list[list[list[int]]]  # each epoch's global batches
    batching: str
    target_meta: dict[str, str]  # the hidden-state files' metadata: the target's name and fingerprint
    positions: int  # tokens an epoch trains
    mask_token_id: int | None = None  # online DFlash: the mask token the first start chose
    max_length: int = 0
    reading: Reading | None = field(default=None, init=False)

    def open(self, reading: Reading) -> None:
        self.reading = reading

    def batches(self, epoch: int, first: int) -> Iterator[Step]:
        raise NotImplementedError

    def after_step(self, epoch: int, index: int) -> None:
        """The step that read global batch ``index`` of ``epoch`` is done (every rank has its data)."""

    def after_checkpoint(self, position: ckpt.Position) -> None:
        """A checkpoint at ``position`` is on the volume."""

    def finish(self) -> None:
        """Training has ended."""

    def checkpoint_extra(self) -> dict:
        """What a checkpoint records of the source beside the position."""
        return {}

    def share_of(self, global_batch: list[int]) -> tuple[list[int], bool]:
        """This rank's file indices of ``global_batch``, and whether they are a stand-in (``batching.share``)."""
        assert self.reading is not None
        part = share(global_batch, self.reading.rank, self.reading.world)
        return part.indices, part.filler


class StoredFiles(Source):
    """An offline run's files, every one verified before training starts, read and padded by a ``DataLoader``
    (on a GPU in worker processes, into pinned memory, while the GPU works)."""

    def batches(self, epoch: int, first: int) -> Iterator[Step]:
        assert self.reading is not None
        plan = self.plans[epoch][first:]
        shares = [self.share_of(batch) for batch in plan]
        for offset, batch in enumerate(self._loader([indices for indices, _ in shares])):
            rows, filler = shares[offset]
            yield Step(first + offset, plan[offset], rows, batch.without_loss() if filler else batch)

    def _loader(self, shares: list[list[int]]) -> DataLoader:
        dataset = HiddenStateDataset(self.files, self.max_length)
        if self.reading is None or self.reading.device.type != "cuda":
            return DataLoader(dataset, batch_sampler=shares, collate_fn=collate, num_workers=0)
        # Workers read and pad the next batches while the GPU works, into pinned memory so the copy to the GPU
        # is asynchronous (a pageable copy of an 8B-shape sample held the step for 8 ms).
        return DataLoader(dataset, batch_sampler=shares, collate_fn=collate, num_workers=LOADER_WORKERS,
                          prefetch_factor=LOADER_PREFETCH, pin_memory=True)


def stored_files(spec: RunSpec, paths: RunPaths, *, world: int, rank: int, layer_ids: list[int],
                 hidden_size: int, vocab_size: int) -> StoredFiles:
    """Every file of an offline run, verified before training starts."""
    cfg, max_length = spec.train, spec.train_max_length
    listed = list_hidden_files(paths)
    ids = {path: sample_id for sample_id, path in listed}
    files, held_out = validation_split(listed, cfg.validation_files)
    infos = verify_files([*files, *held_out], layer_ids=layer_ids, hidden_size=hidden_size)[: len(files)]
    if rank == 0:
        report_truncation(infos, max_length, spec)
    lengths = [min(info.num_tokens, max_length) for info in infos]
    batching = checkpoint_batching(paths, cfg)
    epochs = auto_epochs(cfg.epochs, sum(lengths))
    plans = [epoch_plan(cfg, lengths, epoch, world, batching) for epoch in range(epochs)]
    return StoredFiles(files, [ids[path] for path in files], held_out, TokenTally(vocab_size, max_length, files),
                       lengths, epochs, plans, batching, infos[0].metadata, sum(lengths), max_length=max_length)


def report_truncation(infos: list[HiddenFileInfo], max_length: int, spec: RunSpec) -> None:
    """A train.max_length under what extraction kept leaves stored loss tokens untrained: say how many."""
    files, tokens = loss_tokens_beyond(infos, max_length)
    if files:
        log.warning("train.max_length %d is below extraction.max_length %d: %d of %d files are cut, and %d stored "
                    "loss tokens past position %d are never trained on (leave train.max_length unset to train on them)",
                    max_length, spec.extraction.max_length, files, len(infos), tokens, max_length)
