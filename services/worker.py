"""Start an RQ worker the way every draftline worker service does: JSON serializer, named, logged.

Stopping: the first SIGTERM (or SIGINT) lets the current job finish, then the worker exits 0; a second
one, more than a second later, kills the job's work horse and exits at once, leaving the job started
for ``services.controller.reaper`` to requeue. A worker that dies outright (SIGKILL, a lost host) stops
heartbeating; its work horse dies with it, and the reaper requeues the job once the heartbeat is stale.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence

import redis
from rq import Worker

from shared.queues import SERIALIZER, connect, queue
from shared.settings import CommonSettings, configure_logging

log = logging.getLogger(__name__)

# A busy worker heartbeats every JOB_MONITORING_INTERVAL_S (RQ's default is 30 s); the reaper calls a
# worker dead after STALE_HEARTBEAT_S without one, so a killed worker's job is back on its queue within
# about 40 s instead of RQ's own 10-minute maintenance.
JOB_MONITORING_INTERVAL_S = 10
STALE_HEARTBEAT_S = 3 * JOB_MONITORING_INTERVAL_S
# An idle worker heartbeats every WORKER_TTL_S - 15 s (its blocking dequeue's timeout) and vanishes from
# the worker list WORKER_TTL_S + 60 s after its last one (RQ's default TTL is 420 s).
WORKER_TTL_S = 60
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so a work horse never outlives its worker
    and runs on beside the copy of its job that the reaper hands to another worker."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the worker died before the request took effect
        os._exit(1)


class DraftlineWorker(Worker):
    """RQ's forking worker, with a work horse that dies with its worker."""

    def setup_work_horse_signals(self) -> None:
        super().setup_work_horse_signals()
        die_with_parent()


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
    log.info("worker %s: serving %s", name, ", ".join(queue_names))
    worker.work(burst=burst, logging_level=settings.log_level)
