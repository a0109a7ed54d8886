"""The online source: an online run's batches, each waited for on the volume as training reaches it, read from the
files extraction lands in the trainer's order, and released once the step that read them is done.

Built from the run's plan (``online_plan.py``: the samples, their lengths, the draft vocabulary's tally) and its
feed (``online.py``: the window asked for ahead, the waits, the releases). The loop reads it like the offline
source (``sources.py``). Each step's batch is waited for in the training process itself, then read; on a GPU a
few reader processes read and pad the batches after it whose files are all in, while the GPU works, so a step never
waits for a batch further ahead than its own. They are processes, as offline's ``DataLoader`` workers are, so that
reading does not hold the interpreter lock the loop's thread needs to launch the step's kernels; a batch comes back
through shared memory and is pinned in the main process (on the pool's result thread) for an asynchronous copy.

A stop requested while the trainer waits for files: one training process checkpoints where training stands and
stops (``StopWhileWaiting``); of several, rank 0 writes that checkpoint at once, so nothing is lost if the
processes are killed, and every rank stops after the step the files arrive for (the stop is agreed at each
step's all-reduce: no rank may leave a collective its peers have entered).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import torch.multiprocessing

from runtime.runstate import RunState
from services.trainer import checkpoint as ckpt
from services.trainer.data import Batch, HiddenStateDataset, collate, verify_files
from services.trainer.online import Feed, GlobalBatchFailed
from services.trainer.online_plan import (OnlinePlanError, ReplyTokens, load_plan, plan_facts, plan_failure_record,
                                          record_facts, wait_for_facts)
from services.trainer.sources import Reading, Source, Step, auto_epochs, checkpoint_batching, epoch_plan
from shared import eagle3
from shared.hidden_file import verify_hidden_file
from shared.layout import RunPaths
from shared.runspec import RunSpec

log = logging.getLogger(__name__)

PREFETCH_READERS = 4  # per training process on a GPU: processes reading and padding the next ready batches
PREFETCH_BATCHES = 2  # batches read ahead of the one trained
# Devices whose training reads ahead in reader processes; on the CPU the step itself uses every core.
READ_AHEAD_ON = ("cuda",)


class StopWhileWaiting(Exception):  # noqa: N818 - control flow between the source and the loop, not an error
    """A stop was requested while the only training process waited for a step's files."""


@dataclass
class Spool(Source):
    """An online run's files (see the module doc)."""

    feed: Feed | None = None
    facts: dict = field(default_factory=dict)  # what the first start measured and chose (online_plan.FACTS)
    readers: ProcessPoolExecutor | None = field(default=None, init=False)
    pin: bool = field(default=False, init=False)
    pending: dict[tuple[int, int], Future] = field(default_factory=dict, init=False)
    trained: dict[tuple[int, int], list[int]] = field(default_factory=dict, init=False)  # batches yielded, by step
    trained_in_epoch: int = field(default=0, init=False)
    stop_checkpointed: bool = field(default=False, init=False)

    def open(self, reading: Reading) -> None:
        super().open(reading)
        assert self.feed is not None
        position = reading.position
        self.feed.settle(position.epoch, position.batch_in_epoch)
        self.pin = reading.device.type == "cuda"
        if reading.device.type in READ_AHEAD_ON:
            self.readers = start_readers()

    def batches(self, epoch: int, first: int) -> Iterator[Step]:
        assert self.feed is not None
        self.trained_in_epoch = sum(len(b) for b in self.plans[epoch][:first])
        for index in range(first, len(self.plans[epoch])):
            global_batch = self.feed.wait_for(epoch, index, interrupt=self._interrupt)
            batch = self._take(epoch, index, global_batch)
            self.trained[(epoch, index)] = global_batch
            self._prefetch(epoch, index)
            yield Step(index, global_batch, self.share_of(global_batch)[0], batch)

    def after_step(self, epoch: int, index: int) -> None:
        assert self.feed is not None
        done = self.trained.pop((epoch, index), [])
        self.feed.loading -= {self.sample_ids[i] for i in done}
        self.feed.after_step(epoch, index)
        self.trained_in_epoch += len(done)
        self.feed.report(epoch, self.trained_in_epoch)

    def after_checkpoint(self, position: ckpt.Position) -> None:
        assert self.feed is not None
        self.feed.report(min(position.epoch, len(self.plans) - 1), self.trained_in_epoch, force=True)

    def checkpoint_extra(self) -> dict:
        assert self.feed is not None
        return {"online": {"order": "the plan's lengths, batched as offline", "budget_bytes": self.feed.budget}}

    def finish(self) -> None:
        assert self.feed is not None
        self.feed.report(len(self.plans) - 1, self.trained_in_epoch if self.plans else 0, force=True)
        if self.readers is not None:
            self.readers.shutdown(wait=True, cancel_futures=True)

    def _interrupt(self) -> None:
        """At every look while waiting: a stop requested ends the wait (one process) or is made safe (several)."""
        reading = self.reading
        if reading is None or not reading.stop():
            return
        if reading.world == 1:
            raise StopWhileWaiting()
        if reading.rank == 0 and not self.stop_checkpointed:
            reading.checkpoint_now()
            self.stop_checkpointed = True

    def _take(self, epoch: int, index: int, global_batch: list[int]) -> Batch:
        future = self.pending.pop((epoch, index), None)
        if future is not None:
            try:
                loaded_for, batch = future.result()
            except BrokenProcessPool:
                self._restart_readers()  # this batch is read here, and the new readers read the next ones
            else:
                if loaded_for == global_batch:
                    return batch
        return self._load(global_batch)[1]

    def _share(self, global_batch: list[int]) -> tuple[list[str], int, bool]:
        """``read_batch``'s arguments for this rank's share of ``global_batch``."""
        indices, filler = self.share_of(global_batch)
        return [str(self.files[i]) for i in indices], self.max_length, filler

    def _pinned(self, batch: Batch) -> Batch:
        return batch.pin_memory() if self.pin else batch  # the copy to the GPU is then asynchronous

    def _load(self, global_batch: list[int]) -> tuple[list[int], Batch]:
        """``global_batch``'s share read here, in the training process."""
        return global_batch, self._pinned(read_batch(*self._share(global_batch)))

    def _read_ahead(self, global_batch: list[int]) -> Future:
        """``global_batch``'s share read and padded by a reader process, then pinned on the pool's result thread."""
        assert self.readers is not None
        read = self.readers.submit(read_batch, *self._share(global_batch))
        done: Future = Future()

        def pinned(future: Future) -> None:
            try:
                done.set_result((global_batch, self._pinned(future.result())))
            except BaseException as exc:  # noqa: BLE001 - handed to the loop, which reads the batch itself
                done.set_exception(exc)

        read.add_done_callback(pinned)
        return done

    def _restart_readers(self) -> None:
        """A reader died (its memory, a signal) and took its pool with it: a new pool reads the batches ahead."""
        assert self.feed is not None
        log.warning("run %s: a reader process of the online files died; starting new ones", self.feed.state.run)
        if self.readers is not None:
            self.readers.shutdown(wait=False, cancel_futures=True)
        self.pending.clear()  # their batches are read again when the loop reaches them
        self.readers = start_readers()

    def _prefetch(self, epoch: int, index: int) -> None:
        """Read the next batches of the epoch whose files are all in (stopping at the first that is not: they are
        trained in order), marked as being read so no room is made by deleting them."""
        if self.readers is None:
            return
        assert self.feed is not None
        for ahead in range(index + 1, min(index + 1 + PREFETCH_BATCHES, len(self.plans[epoch]))):
            if (epoch, ahead) in self.pending:
                continue
            try:
                settled = self.feed.settled(epoch, ahead)
            except GlobalBatchFailed:
                return  # raised when the loop reaches it
            if settled is None:
                return
            self.feed.loading |= {self.sample_ids[i] for i in settled}
            try:
                self.pending[(epoch, ahead)] = self._read_ahead(settled)
            except BrokenProcessPool:
                self._restart_readers()
                return


def start_readers() -> ProcessPoolExecutor:
    """The reader processes: started by a fork server, so none inherits the training process's CUDA context or
    threads; each imports this module once."""
    return ProcessPoolExecutor(PREFETCH_READERS, mp_context=torch.multiprocessing.get_context("forkserver"))


def read_batch(files: list[str], max_length: int, filler: bool) -> Batch:
    """``files``' first ``max_length`` rows, padded into one batch (a stand-in's without loss). In a reader process,
    its tensors go back to the training process through shared memory (torch's reductions for multiprocessing)."""
    dataset = HiddenStateDataset([Path(f) for f in files], max_length)
    batch = collate([dataset[i] for i in range(len(files))])
    return batch.without_loss() if filler else batch


def spool(spec: RunSpec, paths: RunPaths, state: RunState | None, *, world: int, rank: int, layer_ids: list[int],
          hidden_size: int, vocab_size: int, model_dir, trust_remote_code: bool = False) -> Spool:
    """The online source: the plan and its tally (rank 0 makes them on the first start), the epochs planned by
    length, the held-out files waited for and verified, and the feed that asks for the rest as training goes."""
    if state is None:
        raise OnlinePlanError(f"run {spec.name} trains online: its trainer needs the run's Redis state")
    cfg, max_length = spec.train, spec.train_max_length
    record = (lambda failure: state.mark_failed(plan_failure_record(spec.name, failure))) if rank == 0 else None
    plan, tally = load_plan(paths, spec, rank, ReplyTokens(paths, spec, model_dir, trust_remote_code),
                            vocab_size=vocab_size, **({"on_failure": record} if record else {}))
    lengths = [min(n, max_length) for n in plan.tokens]
    facts = plan_facts(paths) if rank == 0 else wait_for_facts(paths)
    fresh = facts is None
    if fresh:
        facts = {"epochs": auto_epochs(cfg.epochs, sum(lengths)), "positions": sum(lengths)}
    batching = checkpoint_batching(paths, cfg)
    epochs = range(int(facts["epochs"]))
    span = cfg.global_batch_size if cfg.global_batch_size is not None else cfg.batch_size * world
    feed = Feed(state, plan, [], rank, int(spec.online.budget_bytes or 0), span)
    feed.start()
    feed.wait_ready(plan.validation_ids)  # their sizes price the files to come
    held_out = [paths.hidden(i) for i in plan.validation_ids if i not in feed.failed]
    infos = verify_files(held_out, layer_ids=layer_ids, hidden_size=hidden_size) if held_out else []
    if fresh:
        uncapped = [epoch_plan(cfg, lengths, epoch, world, batching) for epoch in epochs]
        facts["batch_token_cap"] = feed.batch_token_cap(uncapped, lengths)
        if facts["batch_token_cap"] is not None:
            log.info("run %s: online.budget_bytes %d holds two of the longest batches' files only up to %d padded "
                     "tokens a batch: online batches are cut there too", spec.name, feed.budget, facts["batch_token_cap"])
    plans = [epoch_plan(cfg, lengths, epoch, world, batching, facts.get("batch_token_cap")) for epoch in epochs]
    feed.plans = plans
    if "target_model" not in facts:
        facts.update(_target_facts(spec, infos, feed, plans, layer_ids=layer_ids, hidden_size=hidden_size))
    target_meta = {eagle3.META_MODEL: facts["target_model"], eagle3.META_MODEL_FINGERPRINT: facts["target_fingerprint"]}
    return Spool([paths.hidden(i) for i in plan.train_ids], list(plan.train_ids), held_out, tally, lengths,
                 len(plans), plans, batching, target_meta, int(facts["positions"]), facts.get("mask_token_id"),
                 max_length=max_length, feed=feed, facts=facts if fresh else {})


def _target_facts(spec: RunSpec, infos: list, feed: Feed, plans: list[list[list[int]]], *, layer_ids: list[int],
                  hidden_size: int) -> dict:
    """The target's name and fingerprint, as the files record them: a held-out file's, or, with none held out, the
    first training batch's first file (waited for now; step 1 reads it next), verified against the run's layers."""
    if not infos:
        first = [feed.plan.train_ids[i] for i in plans[0][0]]
        if feed.leader:
            feed.ask(first)
        feed.wait_ready(first)
        path = next((feed.paths.hidden(i) for i in first if i not in feed.failed), None)
        if path is None:
            raise OnlinePlanError(f"run {spec.name}: every sample of the first batch failed extraction")
        infos = [verify_hidden_file(path, layer_ids=layer_ids, hidden_size=hidden_size)]
    meta = infos[0].metadata
    return {"target_model": meta.get(eagle3.META_MODEL, spec.model),
            "target_fingerprint": meta.get(eagle3.META_MODEL_FINGERPRINT, "")}


def record_online_facts(source: Source, paths: RunPaths, mask_token_id: int | None, rank: int) -> None:
    """Rank 0 records what its first start measured and chose, for every resume (``online_plan.plan_facts``)."""
    if not isinstance(source, Spool) or rank != 0 or not source.facts:
        return
    facts = dict(source.facts)
    if mask_token_id is not None:
        facts["mask_token_id"] = mask_token_id
    record_facts(paths, facts)

