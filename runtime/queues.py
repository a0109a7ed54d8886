"""Redis connections and RQ queues, always with the JSON serializer (no pickle crosses Redis)."""

from __future__ import annotations

import functools

import redis
from rq import Queue
from rq.serializers import JSONSerializer

SERIALIZER = JSONSerializer


def connect(url: str) -> redis.Redis:
    """A Redis connection that fails fast when the server is gone instead of hanging a worker."""
    return redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30, health_check_interval=30)


@functools.cache
def job_connection(url: str) -> redis.Redis:
    """``connect(url)`` once per process, for job functions: a worker running jobs inline keeps one
    connection pool (and its open connections) across jobs instead of dialing Redis again for each;
    a forked work horse builds its own, and redis-py resets a pool it finds in another process."""
    return connect(url)


def queue(name: str, conn: redis.Redis) -> Queue:
    return Queue(name, connection=conn, serializer=SERIALIZER)
