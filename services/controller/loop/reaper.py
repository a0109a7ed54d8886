"""Put the jobs of dead workers back on their queues, long before RQ's own maintenance would.

RQ notices a dead worker's job only when a live worker's maintenance runs (every 10 minutes) and then
fails it as ``AbandonedJobError``. Here a started job counts as abandoned as soon as the worker running
it is gone: its worker hash expired or records a death (a cold shutdown), or its last heartbeat is older
than ``STALE_HEARTBEAT_S`` while a busy worker heartbeats every ``JOB_MONITORING_INTERVAL_S``. Called
every few seconds by the supervisor, a killed worker's job is queued again, under the same job id,
within about 40 seconds. Heartbeat ages compare the worker's clock with ours, so hosts keep their clocks
in sync (NTP), as RQ itself assumes.

A worker killed between taking a job off its queue and starting it leaves the job in neither: RQ
moves a dequeued job into the queue's intermediate list, and only into the started registry when it
prepares the execution. RQ's own maintenance fails such a job after a minute ("stuck in intermediate
queue"); here a job seen there, not started, across ``STUCK_DEQUEUED_S`` is queued again instead.

The requeue itself (front of the queue, counted, failed after ``MAX_REQUEUES``) is
``runtime.requeue``'s, which a worker whose work horse was killed uses too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis
from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.utils import utcparse

from shared.jobs import QUEUES
from runtime.queues import SERIALIZER, queue
from runtime.requeue import requeue_lost
from runtime.worker import STALE_HEARTBEAT_S, DraftlineWorker

log = logging.getLogger(__name__)

# Statuses of a job still held by its worker: queued lasts from the dequeue until the work horse starts.
HELD = (JobStatus.STARTED, JobStatus.QUEUED)
# A live worker starts a dequeued job within milliseconds; one still not started after this long was
# taken by a worker that died. Shorter than RQ's own minute, so the job is requeued before RQ fails it.
STUCK_DEQUEUED_S = 30.0
FIRST_SEEN_KEY = "draftline:dequeued-first-seen:{queue}:{job}"


@dataclass(frozen=True)
class StartedEntry:
    """One member of a StartedJobRegistry: a job id, an execution id, the raw member for ZREM."""

    job_id: str
    execution_id: str
    member: bytes


def requeue_abandoned(conn: redis.Redis, queues: Iterable[str] = QUEUES, *,
                      stale_after_s: float = STALE_HEARTBEAT_S) -> int:
    """Requeue every started job of ``queues`` whose worker is dead; returns how many were requeued."""
    requeued = 0
    now = time.time()
    for name in queues:
        q = queue(name, conn)
        for entry in started_entries(q):
            worker = worker_of(conn, entry)
            if worker_alive(conn, worker, now, stale_after_s):
                continue
            requeued += reclaim(q, entry, worker)
        requeued += requeue_stuck_dequeued(q, now, stuck_after_s=STUCK_DEQUEUED_S)
    return requeued


def requeue_stuck_dequeued(q: Queue, now: float, *, stuck_after_s: float) -> int:
    """Queue again every job of ``q``'s intermediate list that is not started and was first seen there at
    least ``stuck_after_s`` ago; returns how many were requeued."""
    conn = q.connection
    started = {entry.job_id for entry in started_entries(q)}
    requeued = 0
    taken = q.intermediate_queue.get_job_ids()
    forget_first_seen(q, set(taken) - started)
    for job_id in taken:
        if job_id in started:
            continue
        key = FIRST_SEEN_KEY.format(queue=q.name, job=job_id)
        conn.set(key, now, nx=True, ex=3600)
        first_seen = float(conn.get(key) or now)
        if now - first_seen < stuck_after_s:
            continue
        if not conn.lrem(q.intermediate_queue_key, 1, job_id):
            continue  # a worker started it after all, or another reaper took it: the LREM is the claim
        conn.delete(key)
        try:
            job = Job.fetch(job_id, connection=conn, serializer=SERIALIZER)
        except NoSuchJobError:
            continue
        if job.get_status(refresh=False) != JobStatus.QUEUED:
            continue
        requeued += int(requeue_lost(job, q, cause=f"taken off {q.name} by a worker that died before starting it "
                                                 f"(not started after {now - first_seen:.0f}s)"))
    return requeued


def forget_first_seen(q: Queue, waiting: set[str]) -> None:
    """Drop the first-seen marks of jobs that left ``q``'s intermediate list (started, or requeued): a job seen
    there for a moment on its way to a worker must not leave a key behind for an hour."""
    conn = q.connection
    prefix = FIRST_SEEN_KEY.format(queue=q.name, job="")
    for key in conn.scan_iter(match=prefix + "*", count=1000):
        name = key.decode() if isinstance(key, bytes) else key
        if name[len(prefix):] not in waiting:
            conn.delete(name)


def started_entries(q: Queue) -> list[StartedEntry]:
    """The registry's members read as they are: RQ's ``get_job_ids`` would first fail expired ones."""
    entries = []
    for member in q.connection.zrange(q.started_job_registry.key, 0, -1):
        job_id, _, execution_id = member.decode().rpartition(":")
        if job_id:
            entries.append(StartedEntry(job_id, execution_id, member))
    return entries


def worker_of(conn: redis.Redis, entry: StartedEntry) -> str:
    """The name of the worker running ``entry``: from its execution, else from the job hash."""
    execution_key = Execution(entry.execution_id, entry.job_id, conn).key
    name = conn.hget(execution_key, "worker_name") or conn.hget(Job.key_for(entry.job_id), "worker_name")
    return name.decode() if name else ""


def worker_alive(conn: redis.Redis, name: str, now: float, stale_after_s: float) -> bool:
    """A worker lives while its hash exists without a death mark and its last heartbeat is recent."""
    if not name:
        return False
    fields = conn.hmget(DraftlineWorker.redis_worker_namespace_prefix + name, ["last_heartbeat", "death"])
    heartbeat, death = fields
    if heartbeat is None or death is not None:
        return False
    return now - utcparse(heartbeat.decode()).timestamp() < stale_after_s


def reclaim(q: Queue, entry: StartedEntry, worker: str) -> int:
    """Take ``entry`` off the started registry and queue its job again; 1 when this call did it.

    Removing the registry member is the claim: of two reapers, or a reaper and a worker finishing after
    all, only the one whose ZREM removed it goes on."""
    conn = q.connection
    if not conn.zrem(q.started_job_registry.key, entry.member):
        return 0
    try:
        job = Job.fetch(entry.job_id, connection=conn, serializer=SERIALIZER)
    except NoSuchJobError:
        return 0
    forget_execution(job, entry, worker)
    if job.get_status(refresh=False) not in HELD:
        return 0
    return int(requeue_lost(job, q, cause=f"worker {worker or '(unknown)'} is dead"))


def forget_execution(job: Job, entry: StartedEntry, worker: str) -> None:
    """Drop the dead execution's records (its hash, the job's execution registry, the worker's index) the
    way RQ itself deletes an execution, so nothing counts it as running any more."""
    execution = Execution(entry.execution_id, entry.job_id, job.connection, worker_name=worker)
    with job.connection.pipeline() as pipe:
        execution.delete(job=job, pipeline=pipe)
        pipe.execute()
