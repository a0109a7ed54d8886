"""Living through a Redis restart or a dropped connection: wait with backoff, say so once, go on.

A long-running process (a worker, the controller) keeps one ``RedisOutage`` and reports to it: ``down``
when a Redis call fails on the connection, ``up`` when one succeeds again. It logs the first failure of
an outage and its end, not every retry in between, so an operator reads two lines per outage.
"""

from __future__ import annotations

import logging
import time

import redis

log = logging.getLogger(__name__)

# What a lost or restarting server raises; a refused command (a wrong type, say) is a bug, not an outage.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
FIRST_RETRY_S = 0.5
MAX_RETRY_S = 10.0


class RedisOutage:
    """The state of one process's view of Redis: up, or down since a moment."""

    def __init__(self, who: str, url: str = "") -> None:
        self.who = who
        self.url = url
        self.since: float | None = None  # monotonic time of the outage's first failure; None while up

    @property
    def is_down(self) -> bool:
        return self.since is not None

    def down(self, exc: BaseException) -> None:
        if self.since is None:
            self.since = time.monotonic()
            log.warning("%s: redis %sunreachable (%s: %s); waiting for it with backoff",
                        self.who, f"at {self.url} " if self.url else "", type(exc).__name__, exc)

    def up(self) -> bool:
        """Note a successful call; True when it ends an outage (logged once)."""
        if self.since is None:
            return False
        log.warning("%s: redis is back after %.1fs", self.who, time.monotonic() - self.since)
        self.since = None
        return True

    def wait(self, conn: redis.Redis, *, max_wait_s: float | None = None) -> None:
        """Block until ``conn`` answers a PING, retrying with exponential backoff up to ``MAX_RETRY_S``.
        Raises the last error once ``max_wait_s`` has passed (None: wait as long as it takes)."""
        deadline = None if max_wait_s is None else time.monotonic() + max_wait_s
        delay = FIRST_RETRY_S
        while True:
            try:
                conn.ping()
                self.up()
                return
            except REDIS_DOWN as exc:
                self.down(exc)
                if deadline is not None and time.monotonic() > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_S)
