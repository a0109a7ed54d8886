"""What RQ's worker records say about the jobs each live worker ran.

A worker counts its successful jobs in its own hash (``rq:worker:<name>``) in the same transaction that
settles each job, so the count survives the job records: a sample job is deleted the moment it succeeds
(shared.jobs.DEFAULT_SAMPLE_RESULT_TTL_S). The hash lives while the worker does, and 60 s after it stops.
"""

from __future__ import annotations

import redis

from runtime.worker import DraftlineWorker


def successful_jobs(conn: redis.Redis) -> dict[str, int]:
    """Worker name -> jobs it finished successfully, for every worker registered now."""
    prefix = DraftlineWorker.redis_worker_namespace_prefix
    counts = {}
    for key in sorted(k.decode() for k in conn.smembers(DraftlineWorker.redis_workers_keys)):
        counts[key.removeprefix(prefix)] = int(conn.hget(key, "successful_job_count") or 0)
    return counts
