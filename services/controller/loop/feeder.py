"""Feeding a run's queues by scanning its sample ids against what the run's bitmaps say is settled.

Two cursors per run live in the run's meta, and a resume resets both, so the feeder re-scans:

- **generate**: a byte offset into ``prompts.jsonl``. Ids already settled in generate (done, failed or
  dropped) are passed over; the rest go out in batches of ``generate_batch``, while fewer than
  ``feed_window`` of the run's generate jobs wait and fewer than ``extract_backlog`` extractions wait.
- **extract backfill**: a sample id. Ids whose reply is done but whose extraction is not settled get
  extract jobs of up to ``extract_batch`` samples while fewer than ``extract_backlog`` extract jobs wait.
  The generator queues its job's extractions itself when the job ends; the backfill catches those lost
  with Redis or with a crash between the two steps.

When a cursor reaches the end while its stage still has unsettled ids, it starts another pass (at most
every ``REPASS_INTERVAL_S``; the generate cursor only once none of the run's generate jobs waits or
runs). No pass duplicates work: generate skips the ids of the run's waiting and running generate jobs;
the backfill skips the ids that the run's waiting, taken or running extract jobs hold, and those of its
generate jobs in flight (their generator queues them as they end); job ids are deterministic and
enqueued with ``unique=True`` (``runtime.sample_queue``). A job id that still names a *finished* job
(kept ``sample_result_ttl_s``, 0 by default) is replaced, since its samples are evidently not settled.

A run of millions of rows costs Redis a few kilobytes of queue; the volume holds the rest.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import redis

from shared.jobs import (
    DEFAULT_SAMPLE_RESULT_TTL_S,
    EXTRACT_QUEUE,
    GENERATE_FUNC,
    GENERATE_QUEUE,
    GenerateJob,
    PromptItem,
    extract_job_id,
    generate_job_id,
)
from shared.layout import RunPaths
from shared.lifecycle import OUTCOMES, Outcome, Stage
from shared.runspec import cached_spec
from runtime.queues import queue
from runtime.runstate import RunState
from runtime.sample_queue import enqueue_extract, enqueue_once, held_sample_ids
from shared.settings import ControllerSettings

log = logging.getLogger(__name__)

# A generate job holds several samples, each up to a long reply with retries; RQ's 180 s default is far too short.
GENERATE_JOB_TIMEOUT_S = 6 * 3600
SCAN_LINES_PER_TICK = 50_000  # prompt lines one tick reads at most, so a tick stays short on huge runs
SCAN_IDS_PER_TICK = 262_144  # sample ids the backfill checks per tick at most (32 KiB of each bitmap)
BITMAP_CHUNK = 8192
REPASS_INTERVAL_S = 60.0

# prompts.jsonl lines start with the id (submit.prompt_line), so passing over a settled row parses no JSON.
_ID_PREFIX = re.compile(rb'^\{"sample_id": (\d+)[,}]')


# ---- queues --------------------------------------------------------------------------------------


def inflight_generate(conn: redis.Redis, run: str) -> tuple[int, set[int]]:
    """(waiting jobs of ``run``, sample ids in its waiting or running generate jobs); both are bounded by
    the feed window and the number of workers, so listing them is cheap."""
    return held_sample_ids(conn, GENERATE_QUEUE, _stem(generate_job_id(run, 0)))


def held_extract(conn: redis.Redis, run: str) -> set[int]:
    """Sample ids the backfill leaves alone: those of ``run``'s generate jobs in flight (their generator
    queues them as they end), then those its extract jobs hold, read in that order so that a generate job
    that ends meanwhile has its extract job seen."""
    _, generating = inflight_generate(conn, run)
    _, extracting = held_sample_ids(conn, EXTRACT_QUEUE, _stem(extract_job_id(run, 0)))
    return generating | extracting


def _stem(job_id: str) -> str:
    return job_id.rsplit("_", 1)[0]


def extract_room(settings: ControllerSettings, conn: redis.Redis) -> int:
    return settings.extract_backlog - queue(EXTRACT_QUEUE, conn).count


# ---- bitmaps, read in chunks ---------------------------------------------------------------------


class Outcomes:
    """A run's per-sample outcomes of one stage, fetched from Redis ``BITMAP_CHUNK`` ids at a time."""

    def __init__(self, state: RunState, stage: Stage) -> None:
        self.state, self.stage = state, stage
        self._start, self._bits = -1, {}

    def settled(self, sample_id: int) -> bool:
        bits, i = self._chunk(sample_id)
        return any(bool(bits[outcome][i]) for outcome in OUTCOMES)

    def _chunk(self, sample_id: int) -> tuple[dict[Outcome, np.ndarray], int]:
        start = sample_id - sample_id % BITMAP_CHUNK
        if start != self._start:
            self._start, self._bits = start, self.state.outcomes(self.stage, start, start + BITMAP_CHUNK)
        return self._bits, sample_id - start


# ---- generate ------------------------------------------------------------------------------------


@dataclass
class Scan:
    items: list[PromptItem]
    offset: int  # byte offset just past the last line looked at
    lines: int  # lines looked at
    at_end: bool


def scan_prompts(paths: RunPaths, offset: int, size: int, *, skip: Callable[[int], bool], max_lines: int) -> Scan:
    """Up to ``size`` prompts from byte ``offset`` on whose id ``skip`` refuses, reading at most ``max_lines``."""
    items: list[PromptItem] = []
    lines = 0
    with open(paths.prompts, "rb") as handle:
        handle.seek(offset)
        while len(items) < size and lines < max_lines:
            line = handle.readline()
            if not line.endswith(b"\n"):
                return Scan(items, offset, lines, at_end=True)  # prompts.jsonl is published whole: no torn line
            offset, lines = offset + len(line), lines + 1
            match = _ID_PREFIX.match(line)
            sample_id = int(match.group(1)) if match else int(json.loads(line)["sample_id"])
            if skip(sample_id):
                continue
            row = json.loads(line)
            items.append(PromptItem(sample_id=sample_id, messages=row["messages"]))
        at_end = not handle.read(1)
    return Scan(items, offset, lines, at_end)


def enqueue_generate(conn: redis.Redis, job: GenerateJob, *, result_ttl: int = DEFAULT_SAMPLE_RESULT_TTL_S) -> bool:
    """Enqueue once per deterministic id; False when that job already waits or runs."""
    return enqueue_once(conn, GENERATE_QUEUE, GENERATE_FUNC, job.model_dump(mode="json"),
                        generate_job_id(job.run, job.items[0].sample_id), GENERATE_JOB_TIMEOUT_S, result_ttl=result_ttl)


def feed_run(settings: ControllerSettings, state: RunState) -> int:
    """Top up the run's generate jobs with ids not yet settled; returns how many jobs were enqueued."""
    conn, run = state.conn, state.run
    meta = state.meta()
    if "prompts_bytes" not in meta:
        return 0  # the run's meta is gone with Redis; the supervisor rebuilds it before anything is fed
    end = int(meta["prompts_bytes"])
    offset = _generate_cursor(state, meta, end)
    if offset == end or extract_room(settings, conn) <= 0:
        return 0
    waiting, inflight = inflight_generate(conn, run)
    room = settings.feed_window - waiting
    gen = Outcomes(state, Stage.GENERATE)

    def skip(sample_id: int) -> bool:
        return sample_id in inflight or gen.settled(sample_id)

    enqueued, budget = 0, SCAN_LINES_PER_TICK
    while room > 0 and budget > 0 and offset != end and extract_room(settings, conn) > 0:
        scan = scan_prompts(state.paths, offset, settings.generate_batch, skip=skip, max_lines=budget)
        job = GenerateJob(run=run, items=scan.items) if scan.items else None
        if job and enqueue_generate(conn, job, result_ttl=settings.sample_result_ttl_s):
            enqueued, room = enqueued + 1, room - 1
        offset, budget = (end if scan.at_end else scan.offset), budget - scan.lines
        state.set_meta(feed_offset=offset, fed_until=_fed_until(scan, meta))
    if enqueued:
        log.info("run %s: fed %d generate jobs (cursor at byte %d)", run, enqueued, offset)
    return enqueued


def _fed_until(scan: Scan, meta: dict[str, str]) -> int:
    return scan.items[-1].sample_id + 1 if scan.items else int(meta.get("fed_until", 0))


def _generate_cursor(state: RunState, meta: dict[str, str], end: int) -> int:
    """The cursor, moved back to the start when a finished pass left unsettled ids nobody is working on."""
    offset = int(meta.get("feed_offset", 0))
    if offset == 0 and "feed_pass_at" not in meta:
        state.set_meta(feed_pass_at=time.time())
    if offset != end:
        return offset
    if state.counts(Stage.GENERATE).settled >= int(meta.get("expected", 0)) or not _repass_due(meta, "feed"):
        return offset
    waiting, inflight = inflight_generate(state.conn, state.run)
    if waiting or inflight:
        return offset
    log.warning("run %s: generation ended a pass with unsettled samples and no job left; scanning again", state.run)
    state.set_meta(feed_offset=0, feed_pass_at=time.time())
    return 0


def _repass_due(meta: dict[str, str], name: str) -> bool:
    return time.time() - float(meta.get(f"{name}_pass_at", 0)) >= REPASS_INTERVAL_S


def feed_finished(meta: dict[str, str]) -> bool:
    return "prompts_bytes" in meta and meta.get("feed_offset") == meta.get("prompts_bytes")


# ---- extract backfill ----------------------------------------------------------------------------


def backfill_extract(settings: ControllerSettings, state: RunState) -> int:
    """Queue extractions for replies that have none, within the extract backlog; returns how many samples."""
    conn, run = state.conn, state.run
    if cached_spec(settings.data, run).online.enabled:
        return 0  # its trainer asks for each sample's states in its own order, within the run's budget
    meta = state.meta()
    limit = int(meta.get("train_ids", 0))
    cursor = _extract_cursor(state, meta, limit)
    room = extract_room(settings, conn)
    if cursor >= limit or room <= 0:
        return 0
    # Read before the bitmaps: a job that ends after this has its samples settled in what is read next.
    held = held_extract(conn, run)
    jobs, samples, stop = 0, 0, min(limit, cursor + SCAN_IDS_PER_TICK)
    while cursor < stop and jobs < room:
        chunk_end = min(stop, cursor + BITMAP_CHUNK)
        cursor, batches = _backfill_chunk(state, cursor, chunk_end, held, room - jobs, settings)
        jobs, samples = jobs + len(batches), samples + sum(map(len, batches))
        state.set_meta(extract_cursor=cursor)
    if samples:
        log.info("run %s: queued %d extractions whose job was missing, in %d jobs (cursor at sample %d)",
                 run, samples, jobs, cursor)
    return samples


def _backfill_chunk(state: RunState, start: int, stop: int, held: set[int], room: int,
                    settings: ControllerSettings) -> tuple[int, list[list[int]]]:
    """Enqueue jobs for ids ``start..stop-1`` until ``room`` jobs are queued; (next cursor, batches queued)."""
    gen, ext = state.outcomes(Stage.GENERATE, start, stop), state.outcomes(Stage.EXTRACT, start, stop)
    wanted = gen[Outcome.DONE] & ~(ext[Outcome.DONE] | ext[Outcome.FAILED] | ext[Outcome.DROPPED])
    ids = [start + index for index in np.flatnonzero(wanted).tolist() if start + index not in held]
    queued: list[list[int]] = []
    for first in range(0, len(ids), settings.extract_batch):
        if len(queued) >= room:
            return ids[first], queued
        queued += enqueue_extract(state.conn, state.run, ids[first:first + settings.extract_batch],
                                  batch=settings.extract_batch, result_ttl=settings.sample_result_ttl_s)
    return stop, queued


def _extract_cursor(state: RunState, meta: dict[str, str], limit: int) -> int:
    cursor = int(meta.get("extract_cursor", 0))
    if cursor == 0 and "extract_pass_at" not in meta:
        state.set_meta(extract_pass_at=time.time())
    if cursor < limit or not _repass_due(meta, Stage.EXTRACT):
        return cursor
    if state.counts(Stage.EXTRACT).settled >= state.counts(Stage.GENERATE).done:
        return cursor
    state.set_meta(extract_cursor=0, extract_pass_at=time.time())
    return 0
