"""The online source's reader processes (services/trainer/online_source.py): the batches they read ahead are the
ones the training process would read itself, and a reader that dies costs one batch read in the loop, not the run.
Real Redis, real files, real processes; the CPU made to read ahead as a GPU does."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch

from services.trainer import checkpoint as ckpt
from services.trainer import online_source
from services.trainer.batching import LENGTH
from services.trainer.data import Batch, HiddenStateDataset, collate
from services.trainer.online_source import Spool
from services.trainer.sources import Reading
from tests.services.trainer.test_online import feed_of
from tests.support.spool_files import land

HIDDEN = 8
BATCH = 3


@pytest.fixture()
def spool(data_dir, redis_conn, monkeypatch):
    monkeypatch.setattr(online_source, "READ_AHEAD_ON", ("cpu",))
    monkeypatch.setattr(online_source, "PREFETCH_READERS", 2)
    feed = feed_of(data_dir, redis_conn, samples=12, epochs=1, batch_size=BATCH, budget=10**8)
    ids = list(feed.plan.train_ids)
    source = Spool([feed.paths.hidden(i) for i in ids], ids, [], None, list(feed.plan.tokens), 1, feed.plans, LENGTH,
                   {}, sum(feed.plan.tokens), max_length=64, feed=feed)
    source.open(Reading(rank=0, world=1, device=torch.device("cpu"), position=ckpt.Position(0, 0, 0)))
    for sample_id, tokens in feed.tokens.items():  # extracted as asked, all before the first step
        land(feed.state, sample_id, tokens, hidden=HIDDEN)
    yield source
    source.finish()


def read_here(source: Spool, global_batch: list[int]) -> Batch:
    dataset = HiddenStateDataset(source.files, source.max_length)
    return collate([dataset[i] for i in global_batch])


def same(a: Batch, b: Batch) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("input_ids", "loss_mask", "aux_hidden",
                                                                     "last_hidden", "lengths"))


def test_batches_read_ahead_by_reader_processes_are_those_the_loop_would_read(spool, monkeypatch):
    ahead = []
    read_ahead = spool._read_ahead
    monkeypatch.setattr(spool, "_read_ahead", lambda batch: ahead.append(batch) or read_ahead(batch))
    steps = 0
    for step in spool.batches(0, 0):
        assert same(step.batch, read_here(spool, step.global_batch)), step.index
        spool.after_step(0, step.index)
        steps += 1
    assert steps == len(spool.plans[0]) == 4
    assert ahead == spool.plans[0][1:]  # every batch after the first came from a reader
    assert spool.readers is not None and spool.readers._processes  # noqa: SLF001 - processes, not threads


def test_a_reader_that_dies_costs_one_batch_read_here_and_new_readers_go_on(spool, caplog):
    steps = spool.batches(0, 0)
    first = next(steps)
    assert spool.pending  # the next batches are being read ahead
    for future in list(spool.pending.values()):
        future.result()  # both read: the pool is idle, then killed
    for pid in list(spool.readers._processes):  # noqa: SLF001
        os.kill(pid, signal.SIGKILL)
    spool.after_step(0, first.index)
    with caplog.at_level(logging.WARNING, logger=online_source.__name__):
        rest = []
        for step in steps:
            assert same(step.batch, read_here(spool, step.global_batch)), step.index
            rest.append(step.global_batch)
            spool.after_step(0, step.index)
    assert rest == spool.plans[0][1:]
    assert any("reader process of the online files died" in r.getMessage() for r in caplog.records)
    assert spool.readers is not None and spool.readers.submit(int, 7).result(timeout=60) == 7  # new ones work
