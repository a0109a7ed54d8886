"""What the extract queue holds, read the way the backfill reads it: sample ids per waiting job."""

from __future__ import annotations

import redis

from shared.jobs import EXTRACT_QUEUE, ExtractJob, extract_job_id
from runtime.queues import queue


def extract_batches(conn: redis.Redis) -> dict[str, list[int]]:
    """Waiting extract job id -> its sample ids, in queue order; each id is checked against its first sample."""
    q = queue(EXTRACT_QUEUE, conn)
    found = {}
    for job_id in q.get_job_ids():
        job = ExtractJob.model_validate(q.fetch_job(job_id).args[0])
        assert job_id == extract_job_id(job.run, job.sample_ids[0]), job_id
        found[job_id] = job.sample_ids
    return found


def queued_extractions(conn: redis.Redis) -> list[int]:
    """Every sample id the waiting extract jobs hold, sorted; a sample held twice appears twice."""
    return sorted(i for ids in extract_batches(conn).values() for i in ids)
