"""Which of a worker's inference endpoints to ask next, and which are down.

A client spreads its requests over the endpoints a setting lists (``shared.endpoints``): each request goes to
the endpoint with the fewest of this client's requests in flight, ties broken round-robin from a start the
caller picks (a job passes its first sample id, so RQ's fresh work horse per job does not send every job to
the first endpoint).

An endpoint that fails (nothing listening, a dropped connection, a timeout, a 5xx) cools down: for
``cooldown_s``, doubling per consecutive failure up to ``cooldown_max_s``. While it cools it is asked only
when every endpoint cools; once its cooldown is over a real request probes it again. Only state changes
are logged: an endpoint going down (with its reason) and coming back.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from shared.endpoints import EndpointListError, parse_endpoints, server_root

log = logging.getLogger(__name__)

COOLDOWN_S = 2.0
COOLDOWN_MAX_S = 60.0


@dataclass
class Endpoint:
    """One server root and what this client knows of it."""

    url: str
    in_flight: int = 0
    failures: int = 0  # consecutive; 0 while the endpoint is up
    cool_until: float = 0.0  # monotonic time before which other endpoints are preferred

    def cooling(self, now: float) -> bool:
        return now < self.cool_until


class EndpointPool:
    """The endpoints of one client, used from one thread or one event loop."""

    def __init__(self, urls: str | Sequence[str], *, start: int | None = None, cooldown_s: float = COOLDOWN_S,
                 cooldown_max_s: float = COOLDOWN_MAX_S, clock: Callable[[], float] = time.monotonic) -> None:
        roots = parse_endpoints(urls) if isinstance(urls, str) else tuple(server_root(u) for u in urls)
        if not roots:
            raise EndpointListError("no inference endpoint given")
        self.endpoints = [Endpoint(root) for root in roots]
        self.cooldown_s, self.cooldown_max_s, self.clock = cooldown_s, cooldown_max_s, clock
        self._next = (random.randrange(len(roots)) if start is None else start) % len(roots)

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.endpoints]

    def pick(self, exclude: Collection[str] = ()) -> Endpoint | None:
        """The endpoint to ask next, skipping the urls in ``exclude``; None when every one is excluded.

        Endpoints that are not cooling come first; if all cool, the one whose cooldown ends soonest."""
        now = self.clock()
        candidates = [e for e in self.endpoints if e.url not in exclude]
        if not candidates:
            return None
        ready = [e for e in candidates if not e.cooling(now)] or [min(candidates, key=lambda e: e.cool_until)]
        count = len(self.endpoints)
        chosen = min(ready, key=lambda e: (e.in_flight, (self.endpoints.index(e) - self._next) % count))
        self._next = (self.endpoints.index(chosen) + 1) % count
        return chosen

    def available(self, exclude: Collection[str] = ()) -> bool:
        """Whether an endpoint outside ``exclude`` is not cooling down, i.e. worth failing over to at once."""
        now = self.clock()
        return any(e.url not in exclude and not e.cooling(now) for e in self.endpoints)

    @contextmanager
    def lease(self, endpoint: Endpoint) -> Iterator[Endpoint]:
        """Count a request in flight to ``endpoint`` while the block runs."""
        endpoint.in_flight += 1
        try:
            yield endpoint
        finally:
            endpoint.in_flight -= 1

    def failed(self, endpoint: Endpoint, reason: str) -> None:
        """``endpoint`` failed a request: cool it down, longer each time, unless it already cools (a
        concurrent request saw the same trouble)."""
        now = self.clock()
        if endpoint.cooling(now):
            return
        endpoint.failures += 1
        cooldown = min(self.cooldown_max_s, self.cooldown_s * 2 ** min(endpoint.failures - 1, 30))
        endpoint.cool_until = now + cooldown
        if endpoint.failures == 1 and len(self.endpoints) > 1:
            log.warning("inference endpoint %s is down (%s); using the other endpoints, probing it again in %.0fs",
                        endpoint.url, reason, cooldown)

    def succeeded(self, endpoint: Endpoint) -> None:
        """``endpoint`` answered: it is up."""
        if endpoint.failures and len(self.endpoints) > 1:
            log.info("inference endpoint %s is up again", endpoint.url)
        endpoint.failures, endpoint.cool_until = 0, 0.0

    def revived(self, url: str) -> None:
        """``url`` answers its health check: ask it again at once (a real answer marks it up)."""
        for endpoint in self.endpoints:
            if endpoint.url == url:
                endpoint.cool_until = 0.0
