"""One request's way over a client's inference endpoints: fail over, retry, or wait.

A client hands ``Dispatcher.send`` (sync) or ``Dispatcher.asend`` (async) a function that makes one
attempt against one endpoint's root URL and returns the answer or a ``runtime.retry.Failed``. After a
failed attempt:

- permanent trouble (any other 4xx, a prompt too long) raises at once and goes to no other endpoint:
  the request itself is wrong;
- a full disk (507) is waited out as ``runtime.retry`` says; the volume is shared, so another endpoint
  would say the same;
- any other trouble cools the endpoint down (``shared.endpoints``) and sends the request at once, without
  spending an attempt, to an endpoint this request has not tried and that is not cooling down;
- when no such endpoint is left the round is over and the one-server rules of ``runtime.retry`` apply to
  the last trouble: a down server is waited for (every endpoint's ``/health`` polled, the first to answer
  gets the request), transient trouble spends an attempt and backs off. With one endpoint this is exactly
  the one-server behaviour.

Every attempt after the first calls ``on_retry``, so a job can count its retries. Every pause between attempts
ends early once the worker is told to stop (``runtime.shutdown``), and the request raises ``JobYielded``: a
request that only waits gives its sample back instead of keeping the worker. Nor does a request start, once the
worker is told to stop, while every endpoint is known down.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import httpx

from runtime import shutdown
from runtime.endpoint_pool import Endpoint, EndpointPool
from runtime.retry import (
    AsyncServerWatch,
    Failed,
    Outage,
    Retrier,
    RetryPolicy,
    Trouble,
    health_url,
    wait_until_any_up,
)

T = TypeVar("T")

# A host that is gone drops packets instead of refusing: its request fails over after this, not after the
# full request timeout.
CONNECT_TIMEOUT_S = 10.0


def http_timeout(timeout_s: float) -> httpx.Timeout:
    return httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S))


@dataclass(frozen=True)
class Resend:
    """Send the request again after ``delay_s`` (0: at once, to another endpoint)."""

    delay_s: float = 0.0


@dataclass(frozen=True)
class WaitUp:
    """Every endpoint failed: wait until one answers ``/health``, at most until ``deadline`` (monotonic)."""

    reason: str
    deadline: float


class Request:
    """The decisions of one request, shared by the sync and async senders."""

    def __init__(self, dispatcher: Dispatcher, on_retry: Callable[[], object] | None) -> None:
        self.dispatcher = dispatcher
        self.retrier = Retrier(dispatcher.policy, dispatcher.what)
        self.tried: set[str] = set()  # endpoints that failed this round
        self.on_retry = on_retry
        self.attempts = 0

    def endpoint(self) -> Endpoint:
        endpoint = self.dispatcher.pool.pick(exclude=self.tried)
        assert endpoint is not None, "settle() ends a round before every endpoint is excluded"
        if self.attempts and self.on_retry is not None:
            self.on_retry()
        self.attempts += 1
        return endpoint

    def settle(self, endpoint: Endpoint, result: T | Failed) -> T | Resend | WaitUp:
        """The answer, or what to do next; raise the error of permanent trouble or of a spent request."""
        dispatcher, pool = self.dispatcher, self.dispatcher.pool
        full = isinstance(result, Failed) and result.trouble is Trouble.FULL
        if not full:
            dispatcher.disk_ok()
        if not isinstance(result, Failed) or result.trouble is Trouble.PERMANENT:
            pool.succeeded(endpoint)  # it answered; a 4xx is the request's fault, not the server's
            if isinstance(result, Failed):
                raise result.error
            return result
        if full and self.retrier.should_wait(result):
            return Resend(dispatcher.disk_full(result).pause_s(self.retrier.deadline))
        pool.failed(endpoint, str(result.error))
        self.tried.add(endpoint.url)
        if pool.available(exclude=self.tried):
            return Resend()
        self.tried.clear()
        if self.retrier.should_wait(result):
            return WaitUp(str(result.error), self.retrier.deadline)
        return Resend(self.retrier.retry_delay_s(result))


class Dispatcher:
    """A client's endpoints and retry policy, shared by its requests (one thread or one event loop)."""

    def __init__(self, urls: str | Sequence[str] | EndpointPool, policy: RetryPolicy, what: str, *,
                 start: int | None = None) -> None:
        self.pool = urls if isinstance(urls, EndpointPool) else EndpointPool(urls, start=start)
        self.policy = policy
        self.what = what
        self._full: Outage | None = None
        self._watch = AsyncServerWatch(self.pool, policy)

    def send(self, attempt: Callable[[str], T | Failed], *, on_retry: Callable[[], object] | None = None) -> T:
        self._yield_if_stopping_with_every_endpoint_down()
        request = Request(self, on_retry)
        while True:
            endpoint = request.endpoint()
            with self.pool.lease(endpoint):
                result = attempt(endpoint.url)
            step = request.settle(endpoint, result)
            if isinstance(step, WaitUp):
                self._wait_up(step)
            elif isinstance(step, Resend):
                self._pause(step.delay_s)
            else:
                return step

    async def asend(self, attempt: Callable[[str], Awaitable[T | Failed]], *,
                    on_retry: Callable[[], object] | None = None) -> T:
        self._yield_if_stopping_with_every_endpoint_down()
        request = Request(self, on_retry)
        while True:
            endpoint = request.endpoint()
            with self.pool.lease(endpoint):
                result = await attempt(endpoint.url)
            step = request.settle(endpoint, result)
            if isinstance(step, WaitUp):
                await self._watch.wait(step.reason, step.deadline)
            elif isinstance(step, Resend):
                await self._apause(step.delay_s)
            else:
                return step

    async def aclose(self) -> None:
        await self._watch.aclose()

    def _yield_if_stopping_with_every_endpoint_down(self) -> None:
        """A worker told to stop starts no request while every endpoint is known down: it could only wait, and an
        endpoint that drops packets would first cost it the whole connect timeout."""
        if shutdown.requested() and not self.pool.available():
            shutdown.check(f"every endpoint for a {self.what} was down")

    def _pause(self, seconds: float) -> None:
        """Sleep before the next attempt; raise ``JobYielded`` when the worker is told to stop meanwhile."""
        if seconds > 0:
            shutdown.wait(seconds)
            shutdown.check(f"waiting to send a {self.what} again")

    async def _apause(self, seconds: float) -> None:
        if seconds > 0:
            await shutdown.asleep(seconds)
            shutdown.check(f"waiting to send a {self.what} again")

    def _wait_up(self, step: WaitUp) -> None:
        urls = self.pool.urls
        outage = Outage(urls, "is down", step.reason, self.policy)
        index = wait_until_any_up([health_url(u) for u in urls], outage, step.deadline)
        self.pool.revived(urls[index])

    def disk_full(self, failed: Failed) -> Outage:
        """The full-disk outage this client is in, begun by ``failed`` if it is the first 507."""
        if self._full is None:
            self._full = Outage(self.pool.urls, "has no disk space", str(failed.error), self.policy)
        return self._full

    def disk_ok(self) -> None:
        if self._full is not None:
            self._full.recovered()
            self._full = None
