"""Redis connections and RQ queues, always with the JSON serializer (no pickle crosses Redis)."""

from __future__ import annotations

import redis
from rq import Queue
from rq.serializers import JSONSerializer

SERIALIZER = JSONSerializer


def connect(url: str) -> redis.Redis:
    """A Redis connection that fails fast when the server is gone instead of hanging a worker."""
    return redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30, health_check_interval=30)


def queue(name: str, conn: redis.Redis) -> Queue:
    return Queue(name, connection=conn, serializer=SERIALIZER)
