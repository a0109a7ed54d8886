"""Start an RQ worker the way every draftline worker service does: JSON serializer, named, logged."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence

import redis
from rq import Worker

from shared.queues import SERIALIZER, connect, queue
from shared.settings import CommonSettings, configure_logging

log = logging.getLogger(__name__)


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
    worker = Worker(
        [queue(n, conn) for n in queue_names],
        connection=conn,
        serializer=SERIALIZER,
        name=name,
    )
    log.info("worker %s: serving %s", name, ", ".join(queue_names))
    worker.work(burst=burst, logging_level=settings.log_level)
