"""Queueing sample jobs once: deterministic ids, finished ids reused, and the sample ids queued jobs hold.

An extract job holds a batch of samples (up to ``extract_batch``, ``shared.settings.SampleQueueSettings``),
so RQ's fork and per-job bookkeeping are paid once per batch. Its id names the batch's first sample
(``shared.jobs.extract_job_id``); a batch of one has the id a single sample always had. Two enqueuers
meet in one queue: the generator, which queues its job's replies once they are saved, and the
controller's backfill, which queues replies whose extraction was lost. Neither queues a sample twice:

- an id already taken by a waiting or running job is never enqueued again (``unique=True``); the samples
  of the batch that job does not hold are tried again under the id of their own first sample;
- the backfill passes over every sample a waiting, taken or running job of the run holds
  (``held_sample_ids``), generate jobs included, whose generator queues their extraction as it ends.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import redis
from rq.exceptions import DuplicateJobError, NoSuchJobError
from rq.job import Job, JobStatus

from shared.jobs import (
    DEFAULT_SAMPLE_RESULT_TTL_S,
    EVALUATE_FUNC,
    EVALUATE_JOB_TIMEOUT_S,
    EXTRACT_FUNC,
    EXTRACT_QUEUE,
    RUN_JOB_TTL_S,
    SAMPLE_FAILURE_TTL_S,
    TRAIN_FUNC,
    TRAIN_JOB_TIMEOUT,
    TRAIN_QUEUE,
    EvaluateJob,
    ExtractJob,
    TrainJob,
    evaluate_job_id,
    extract_job_id,
    payload_sample_ids,
    train_job_id,
)
from runtime.queues import SERIALIZER, queue

log = logging.getLogger(__name__)

# A batch of extract_batch samples, each up to a long prompt on a large target, finishes well inside an hour.
EXTRACT_JOB_TIMEOUT_S = 3600
# A failed job is not replaced: its samples are named first (failures.name_failed_jobs), then it is gone.
REPLACEABLE = {JobStatus.FINISHED, JobStatus.STOPPED, JobStatus.CANCELED}


def enqueue_once(conn: redis.Redis, queue_name: str, func: str, payload: dict, job_id: str, timeout: int, *,
                 result_ttl: int = DEFAULT_SAMPLE_RESULT_TTL_S, failure_ttl: int = SAMPLE_FAILURE_TTL_S) -> bool:
    """Enqueue under a deterministic id, kept ``result_ttl`` seconds once finished and ``failure_ttl`` once
    failed; False while a job of that id waits or runs."""
    q = queue(queue_name, conn)
    for _ in range(2):
        try:
            q.enqueue_call(func, args=(payload,), job_id=job_id, timeout=timeout, result_ttl=result_ttl,
                           failure_ttl=failure_ttl, unique=True)
            return True
        except DuplicateJobError:
            if not drop_finished(conn, job_id):
                return False
    return False


def enqueue_train(conn: redis.Redis, run: str, *, replace_failed: bool = False) -> bool:
    """Enqueue the run's train job; False while a job with its id waits or runs. ``replace_failed`` deletes a
    failed one first (``draftline retry`` of a run whose training failed)."""
    if replace_failed:
        drop_failed(conn, train_job_id(run))
    return enqueue_once(conn, TRAIN_QUEUE, TRAIN_FUNC, TrainJob(run=run).model_dump(mode="json"), train_job_id(run),
                        TRAIN_JOB_TIMEOUT, result_ttl=RUN_JOB_TTL_S, failure_ttl=RUN_JOB_TTL_S)


def enqueue_evaluate(conn: redis.Redis, run: str, *, replace_failed: bool = False) -> bool:
    """Enqueue the run's evaluate job, as ``enqueue_train`` does its train job."""
    if replace_failed:
        drop_failed(conn, evaluate_job_id(run))
    return enqueue_once(conn, TRAIN_QUEUE, EVALUATE_FUNC, EvaluateJob(run=run).model_dump(mode="json"),
                        evaluate_job_id(run), EVALUATE_JOB_TIMEOUT_S, result_ttl=RUN_JOB_TTL_S,
                        failure_ttl=RUN_JOB_TTL_S)


def drop_failed(conn: redis.Redis, job_id: str) -> None:
    """Delete the job ``job_id`` if it failed (its record names the error; the run's meta keeps it too)."""
    try:
        job = Job.fetch(job_id, connection=conn, serializer=SERIALIZER)
    except NoSuchJobError:
        return
    if job.get_status(refresh=False) == JobStatus.FAILED:
        job.delete()


def drop_finished(conn: redis.Redis, job_id: str) -> bool:
    """Delete the job ``job_id`` if it already ended; True when the id is free again."""
    try:
        job = Job.fetch(job_id, connection=conn, serializer=SERIALIZER)
    except NoSuchJobError:
        return True
    if job.get_status(refresh=False) not in REPLACEABLE:
        return False
    job.delete()
    return True


def batches(sample_ids: Iterable[int], size: int) -> list[list[int]]:
    """``sample_ids`` sorted, without repeats, cut into runs of at most ``size``."""
    ids = sorted(set(sample_ids))
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def enqueue_extract(conn: redis.Redis, run: str, sample_ids: Iterable[int], *, batch: int,
                    result_ttl: int = DEFAULT_SAMPLE_RESULT_TTL_S) -> list[list[int]]:
    """Queue the extraction of ``sample_ids`` in jobs of at most ``batch`` samples; returns the batches
    queued (samples a waiting or running job already holds are left to it)."""
    queued = []
    for ids in batches(sample_ids, batch):
        while ids:
            if _enqueue_batch(conn, run, ids, result_ttl):
                queued.append(ids)
                break
            ids = _not_held(conn, extract_job_id(run, ids[0]), ids)
    return queued


def _enqueue_batch(conn: redis.Redis, run: str, ids: list[int], result_ttl: int) -> bool:
    payload = ExtractJob(run=run, sample_ids=ids).model_dump(mode="json")
    return enqueue_once(conn, EXTRACT_QUEUE, EXTRACT_FUNC, payload, extract_job_id(run, ids[0]),
                        EXTRACT_JOB_TIMEOUT_S, result_ttl=result_ttl)


def _not_held(conn: redis.Redis, job_id: str, ids: list[int]) -> list[int]:
    """The ids of ``ids`` that the live job ``job_id`` does not hold; its first id is always among those it
    holds, so each call shortens the list and the caller's loop ends."""
    try:
        held = set(payload_sample_ids(_payload(Job.fetch(job_id, connection=conn, serializer=SERIALIZER))))
    except NoSuchJobError:
        held = set()  # it ended between the two calls: its samples are settled or will be backfilled
    held.add(ids[0])
    return [i for i in ids if i not in held]


def _payload(job: Job | None) -> dict:
    try:
        args = job.args if job is not None else ()
    except Exception:  # noqa: BLE001 - an undecodable job holds nothing we can name; RQ fails it on its own
        return {}
    return args[0] if args and isinstance(args[0], dict) else {}


def run_job_ids(conn: redis.Redis, queue_name: str, stem: str) -> tuple[list[str], list[str]]:
    """(waiting, taken or running) ids of ``queue_name``'s jobs whose id starts ``stem`` + ``_<id>``.

    Read in the order a job moves (waiting, taken by a worker, started), so a job that moves meanwhile is
    seen at least once unless it also ended; an ended job's samples are settled in the bitmaps, which the
    caller reads afterwards."""
    q = queue(queue_name, conn)
    waiting = [j for j in q.get_job_ids() if _is_runs(j, stem)]
    taken = [j.decode() for j in conn.lrange(q.intermediate_queue.key, 0, -1)]
    # Without cleanup: RQ's cleanup would fail jobs whose worker looks lost, which is the reaper's call.
    started = q.started_job_registry.get_job_ids(cleanup=False)
    return waiting, [j for j in dict.fromkeys(taken + started) if _is_runs(j, stem)]


def held_sample_ids(conn: redis.Redis, queue_name: str, stem: str) -> tuple[int, set[int]]:
    """(waiting jobs, sample ids in the waiting, taken or running jobs) of one run in ``queue_name``."""
    waiting, running = run_job_ids(conn, queue_name, stem)
    ids: set[int] = set()
    for job in Job.fetch_many(waiting + running, connection=conn, serializer=SERIALIZER):
        ids.update(payload_sample_ids(_payload(job)))
    return len(waiting), ids


def _is_runs(job_id: str, stem: str) -> bool:
    # Ids end in "_<first sample id>"; comparing everything before that keeps run "a" from counting run "a_b".
    return job_id.rsplit("_", 1)[0] == stem
