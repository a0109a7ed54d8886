"""Putting a job whose execution was lost back on its queue: at the front, counted, failed by name at last.

Executions are lost two ways. A worker dies (SIGKILL, a lost host): the controller's reaper notices its
heartbeat stop. A work horse dies by a signal while its worker lives (the kernel's OOM killer, say): the
worker notices at once. Neither says anything is wrong with the job's samples, so both requeue through
``requeue_lost``: the job goes to the *front* of its queue (it has waited its turn already, and the
README promises a killed job runs again within a minute), each requeue counts as a retry of every sample
of the job (``RunState.note_retry``, exported as draftline_stage_retried_total), and a job lost
``MAX_REQUEUES`` times is failed in RQ instead, so a job that takes its process down cannot do it forever.

A job that *yields* (``runtime.shutdown.JobYielded``: its worker was told to stop while the job waited) lost
nothing and tried nothing: ``requeue_yielded`` puts it back at the front the same way, counting neither a requeue
nor a retry, so a worker stopped any number of times never fails the job nor inflates its samples' retries.
"""

from __future__ import annotations

import logging
from pathlib import Path

import redis
from rq.exceptions import DeserializationError
from rq.executions import Execution
from rq.job import Job
from rq.job_lifecycle import record_job_failure
from rq.queue import Queue

from shared.jobs import EXTRACT_FUNC, GENERATE_FUNC, payload_sample_ids
from shared.lifecycle import Stage
from runtime.runstate import RunState

log = logging.getLogger(__name__)

MAX_REQUEUES = 3
REQUEUES_META = "draftline_requeues"


def requeue_lost(job: Job, q: Queue, *, cause: str) -> bool:
    """Queue ``job`` again at the front of ``q`` after ``cause`` lost its execution; False when the job
    was lost too often and is failed instead. The caller has already dropped the lost execution's records."""
    count = int(job.meta.get(REQUEUES_META, 0)) + 1
    if count > MAX_REQUEUES:
        give_up(job, cause)
        return False
    job.meta[REQUEUES_META] = count  # saved with the job by enqueue_job
    to_front(job, q)
    log.warning("job %s: %s; requeued at the front of %s (requeue %d of at most %d)",
                job.id, cause, q.name, count, MAX_REQUEUES)
    note_retries(q.connection, job)
    return True


def requeue_yielded(job: Job, q: Queue, execution: Execution, *, cause: str) -> bool:
    """Queue ``job`` again at the front of ``q`` after its ``execution`` gave its unfinished work back (``cause``
    says why), counted neither as a requeue nor as a retry; False when the execution was no longer registered
    as started (the reaper took the job for lost and requeued it, or Redis lost it), and nothing was done.

    The execution's records go and the job is queued in one transaction: a worker stopped cold in between, or a
    Redis that goes away, leaves the job either started (for the reaper) or queued, never neither."""
    registry = job.started_job_registry.key

    def move(pipe: redis.client.Pipeline) -> bool:
        if pipe.zscore(registry, execution.composite_key) is None:
            return False
        pipe.multi()
        execution.delete(job=job, pipeline=pipe)  # its hash, and its entries in the started and job registries
        pipe.lrem(q.intermediate_queue.key, 0, job.id)
        q.enqueue_job(job, pipeline=pipe, at_front=True)
        return True

    if not q.connection.transaction(move, registry, value_from_callable=True):
        return False
    log.info("job %s yielded: %s; requeued at the front of %s", job.id, cause, q.name)
    return True


def to_front(job: Job, q: Queue) -> None:
    """Put ``job`` at the front of ``q`` (and out of the list of jobs taken but not started) in one transaction."""
    with q.connection.pipeline() as pipe:
        pipe.multi()  # RQ's enqueue_job wants a pipeline in transaction mode before any command
        pipe.lrem(q.intermediate_queue.key, 0, job.id)
        q.enqueue_job(job, pipeline=pipe, at_front=True)
        pipe.execute()


def give_up(job: Job, cause: str) -> None:
    message = f"execution lost {MAX_REQUEUES + 1} times (last: {cause}); not requeued again"
    with job.connection.pipeline() as pipe:
        record_job_failure(job, message, pipe)
        pipe.execute()
    log.error("job %s: %s", job.id, message)


def note_retries(conn: redis.Redis, job: Job) -> None:
    """Count one retry per sample of a requeued generate or extract job; train and evaluate jobs have none."""
    stage = {GENERATE_FUNC: Stage.GENERATE, EXTRACT_FUNC: Stage.EXTRACT}.get(job.func_name)
    try:
        payload = job.args[0] if stage and job.args else None
    except DeserializationError:
        return
    if not isinstance(payload, dict) or not isinstance(payload.get("run"), str):
        return
    samples = len(payload_sample_ids(payload))
    state = RunState(conn, Path(), payload["run"])  # the counter lives in Redis: no volume path is read
    for _ in range(samples):
        state.note_retry(stage)
