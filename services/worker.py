"""Start an RQ worker the way every draftline worker service does: JSON serializer, named, logged.

Stopping: the first SIGTERM (or SIGINT) lets the current job finish, then the worker exits 0; a second
one, more than a second later, kills the job's work horse and exits at once, leaving the job started
for ``services.controller.reaper`` to requeue. A worker that dies outright (SIGKILL, a lost host) stops
heartbeating; its work horse dies with it, and the reaper requeues the job once the heartbeat is stale.

A worker whose data directory is not the controller's volume (``shared.volume``) refuses at start-up and
before every job: it hands the job it just took back to the front of its queue, stops, and exits with
``VolumeMismatch`` naming both volumes, instead of writing files that nobody reads.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import redis
from rq import Queue, Worker
from rq.exceptions import StopRequested
from rq.job import Job

from shared.process import die_with_parent
from shared.queues import SERIALIZER, connect, queue
from shared.settings import CommonSettings, configure_logging
from shared.volume import VolumeMismatch, verify_volume

log = logging.getLogger(__name__)

# A busy worker heartbeats every JOB_MONITORING_INTERVAL_S (RQ's default is 30 s); the reaper calls a
# worker dead after STALE_HEARTBEAT_S without one, so a killed worker's job is back on its queue within
# about 40 s instead of RQ's own 10-minute maintenance.
JOB_MONITORING_INTERVAL_S = 10
STALE_HEARTBEAT_S = 3 * JOB_MONITORING_INTERVAL_S
# An idle worker heartbeats every WORKER_TTL_S - 15 s (its blocking dequeue's timeout) and vanishes from
# the worker list WORKER_TTL_S + 60 s after its last one (RQ's default TTL is 420 s).
WORKER_TTL_S = 60
def hand_back(job: Job, q: Queue) -> None:
    """Return a dequeued job that has not started to the front of its queue, as if never taken.

    RQ moves a job from its single queue to an intermediate list when a worker takes it; the job is
    still ``queued`` until its work horse starts, so putting the id back is all that undoes the take."""
    pipe = q.connection.pipeline(transaction=True)
    pipe.lrem(q.intermediate_queue_key, 1, job.id)
    pipe.lpush(q.key, job.id)
    pipe.execute()


class DraftlineWorker(Worker):
    """RQ's forking worker: a work horse that dies with its worker, and a volume check before each job."""

    data: Path | None = None  # the data directory to check against the controller's volume; None: no check
    refused: VolumeMismatch | None = None

    def setup_work_horse_signals(self) -> None:
        super().setup_work_horse_signals()
        die_with_parent()

    def execute_job(self, job: Job, queue: Queue) -> None:
        if self.data is not None:
            try:
                verify_volume(self.data, self.connection)
            except redis.RedisError as exc:
                # The job cannot reach Redis either; it fails and is requeued the usual way.
                log.warning("worker %s: volume not checked before job %s: %s", self.name, job.id, exc)
            except VolumeMismatch as exc:
                hand_back(job, queue)
                log.error("worker %s: job %s handed back untouched: %s", self.name, job.id, exc)
                self.refused = exc
                raise StopRequested() from None
        super().execute_job(job, queue)


def wait_for_redis(conn: redis.Redis, *, url: str, max_wait_s: float = 300.0) -> None:
    """Block until Redis answers; a worker that starts before Redis waits instead of crashing."""
    deadline = time.monotonic() + max_wait_s
    delay = 0.5
    while True:
        try:
            conn.ping()
            return
        except redis.ConnectionError as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("redis at %s not reachable (%s); retrying in %.1fs", url, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)


def run_worker(
    queue_names: Sequence[str],
    settings: CommonSettings,
    *,
    role: str,
    preload: Callable[[], None] | None = None,
    burst: bool = False,
) -> None:
    """Serve ``queue_names`` until stopped. ``preload`` runs once before forking job processes, so
    what it caches (a tokenizer, say) is shared by every job instead of loaded per job."""
    configure_logging(settings.log_level)
    conn = connect(settings.redis_url)
    wait_for_redis(conn, url=settings.redis_url)
    verify_volume(settings.data, conn)  # refuse before loading anything: a wrong mount is a setup error
    if preload is not None:
        preload()
    name = f"{role}-{socket.gethostname()}-{os.getpid()}"
    worker = DraftlineWorker(
        [queue(n, conn) for n in queue_names],
        connection=conn,
        serializer=SERIALIZER,
        name=name,
        worker_ttl=WORKER_TTL_S,
        job_monitoring_interval=JOB_MONITORING_INTERVAL_S,
    )
    worker.data = settings.data
    log.info("worker %s: serving %s from %s", name, ", ".join(queue_names), settings.data)
    worker.work(burst=burst, logging_level=settings.log_level)
    if worker.refused is not None:
        raise worker.refused
