"""The sliding window between ``prompts.jsonl`` and the generate queue.

Redis holds at most ``feed_window`` generate jobs of a run at a time; the rest of the prompts stay on
the volume behind a byte-offset cursor in the run's meta, so a run of millions of rows costs Redis a
few kilobytes. Generation also pauses while ``extract_backlog`` extractions wait, so replies never
pile up faster than hidden states can be taken.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import redis
from rq.exceptions import DuplicateJobError

from shared.jobs import EXTRACT_QUEUE, GENERATE_FUNC, GENERATE_QUEUE, GenerateJob, PromptItem, generate_job_id
from shared.layout import RunPaths
from shared.queues import queue
from shared.runstate import RunState
from shared.settings import ControllerSettings

log = logging.getLogger(__name__)

# A generate job holds several samples, each up to a long reply with retries; RQ's 180 s default is far too short.
GENERATE_JOB_TIMEOUT_S = 6 * 3600
RESULT_TTL_S = 3600
FAILURE_TTL_S = 7 * 24 * 3600


@dataclass(frozen=True)
class Batch:
    items: list[PromptItem]
    end_offset: int  # byte offset just past the batch's last line


def waiting_jobs(conn: redis.Redis, run: str) -> int:
    """Generate jobs of ``run`` still waiting in the queue (the queue is bounded, so listing it is cheap)."""
    # Ids end in "_<first sample id>"; comparing everything before that keeps run "a" from counting run "a_b".
    stem = generate_job_id(run, 0).rsplit("_", 1)[0]
    return sum(1 for job_id in queue(GENERATE_QUEUE, conn).get_job_ids() if job_id.rsplit("_", 1)[0] == stem)


def read_batch(paths: RunPaths, offset: int, size: int) -> Batch | None:
    """Up to ``size`` prompt lines starting at byte ``offset``; None at the end of the file."""
    items = []
    with open(paths.prompts, "rb") as handle:
        handle.seek(offset)
        while len(items) < size:
            line = handle.readline()
            if not line.endswith(b"\n"):
                break  # end of file (prompts.jsonl is published whole, so never a torn line)
            row = json.loads(line)
            items.append(PromptItem(sample_id=row["sample_id"], messages=row["messages"]))
        end = handle.tell() if items else offset
    return Batch(items, end) if items else None


def enqueue_generate(conn: redis.Redis, job: GenerateJob) -> bool:
    """Enqueue once per deterministic id; False when that job already exists (a feed repeated after a crash)."""
    try:
        queue(GENERATE_QUEUE, conn).enqueue_call(
            GENERATE_FUNC, args=(job.model_dump(mode="json"),), job_id=generate_job_id(job.run, job.items[0].sample_id),
            timeout=GENERATE_JOB_TIMEOUT_S, result_ttl=RESULT_TTL_S, failure_ttl=FAILURE_TTL_S, unique=True,
        )
    except DuplicateJobError:
        return False
    return True


def feed_run(settings: ControllerSettings, conn: redis.Redis, run: str) -> int:
    """Top up ``run``'s generate jobs; returns how many were enqueued."""
    state = RunState(conn, settings.data, run)
    paths = RunPaths(settings.data, run)
    meta = state.meta()
    offset = int(meta.get("feed_offset", 0))
    end = int(meta.get("prompts_bytes", -1))
    room = settings.feed_window - waiting_jobs(conn, run)
    enqueued = 0
    while offset != end and room > 0 and queue(EXTRACT_QUEUE, conn).count < settings.extract_backlog:
        batch = read_batch(paths, offset, settings.generate_batch)
        if batch is None:
            break
        if enqueue_generate(conn, GenerateJob(run=run, items=batch.items)):
            enqueued += 1
            room -= 1
        offset = batch.end_offset
        state.set_meta(feed_offset=offset, fed_until=batch.items[-1].sample_id + 1)
    if enqueued:
        log.info("run %s: fed %d generate jobs (cursor at byte %d)", run, enqueued, offset)
    return enqueued


def feed_finished(meta: dict[str, str]) -> bool:
    return "prompts_bytes" in meta and meta.get("feed_offset") == meta.get("prompts_bytes")
