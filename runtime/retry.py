"""How workers treat trouble with the inference server: retry it, wait it out, or give up at once.

Four kinds of trouble, told apart by ``classify_status`` and ``classify_error``:

- *transient* (timeouts, 5xx, 408, 429, a connection reset mid-request): retried with exponential
  backoff and full jitter, at most ``RetryPolicy.max_attempts`` attempts in all;
- *permanent* (any other 4xx): the request itself is wrong, so it is never sent again;
- *down* (connection refused, cannot connect, name not resolved): the server is not there at all.
  Workers wait for it, polling its ``/health`` with capped backoff, and then carry on; waiting spends no
  attempt, so an inference restart costs no sample;
- *full* (507, the inference server's answer when its disk is full): wait and send again later, also
  without spending attempts.

Waiting has one cap per request, ``RetryPolicy.wait_max_s``; past it the request fails as
``InferenceUnavailable`` naming how long the server was down. With several endpoints
(``shared.endpoints``) a request fails over to another endpoint first (``runtime.dispatch``); the server
counts as down, and is waited for, only when every endpoint is. A worker told to stop ends the wait sooner
(``runtime.shutdown``): the request raises ``JobYielded`` within ``shutdown.POLL_S``, and its sample goes back
to the queue unsettled.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import httpx

from runtime import shutdown
from runtime.endpoint_pool import EndpointPool
from shared.endpoints import server_root
from shared.errors import (
    DraftlineError,
    InferenceRejected,
    InferenceUnavailable,
    PromptTooLong,
)

log = logging.getLogger(__name__)

# One line per minute of outage keeps the log readable across a long model reload.
LOG_EVERY_S = 60.0
HEALTH_TIMEOUT_S = 5.0
INSUFFICIENT_STORAGE = 507
TRANSIENT_STATUS = frozenset({408, 429})
# How the wait cap is set, named in the message of a request that gave up waiting.
WAIT_SETTING = "DRAFTLINE_INFERENCE_WAIT_MAX_S"


class Trouble(str, Enum):
    TRANSIENT = "transient"
    PERMANENT = "permanent"
    DOWN = "down"
    FULL = "full"


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts and backoff for transient trouble, and the cap on waiting for a down or full server."""

    max_attempts: int = 4
    base_delay_s: float = 1.0
    max_delay_s: float = 30.0
    jitter: bool = True
    wait_max_s: float = 2400.0  # 0: never wait; a down or full server is then ordinary transient trouble

    @classmethod
    def from_settings(cls, settings: object) -> RetryPolicy:
        """From a settings object with the ``retry_*`` and ``inference_wait_max_s`` fields (shared.settings)."""
        return cls(max_attempts=settings.retry_max_attempts, base_delay_s=settings.retry_base_delay_s,
                   max_delay_s=settings.retry_max_delay_s, wait_max_s=settings.inference_wait_max_s)

    @classmethod
    def fixed(cls, delays_s: tuple[float, ...] | list[float]) -> RetryPolicy:
        """``len(delays_s)`` retries growing from the first delay to the largest, without jitter or waiting.

        For callers that name their delays outright (tests, mostly); (0.5, 1, 2) gives exactly those."""
        delays = [float(d) for d in delays_s]
        return cls(max_attempts=len(delays) + 1, base_delay_s=delays[0] if delays else 0.0,
                   max_delay_s=max(delays, default=0.0), jitter=False, wait_max_s=0.0)

    @property
    def waits(self) -> bool:
        return self.wait_max_s > 0

    def backoff_s(self, retry: int, rand: Callable[[], float] = random.random) -> float:
        """Delay before retry ``retry`` (0 for the first): full jitter over ``min(max, base * 2**retry)``."""
        ceiling = min(self.max_delay_s, self.base_delay_s * 2 ** min(retry, 62))
        return ceiling * rand() if self.jitter else ceiling


@dataclass(frozen=True)
class Failed:
    """One attempt's trouble: its kind, the error that names it, and the server's Retry-After if any."""

    trouble: Trouble
    error: DraftlineError
    retry_after_s: float | None = None


class Retrier:
    """One request's way through its policy: after each failed attempt, wait, retry, or raise."""

    def __init__(self, policy: RetryPolicy, what: str = "request") -> None:
        self.policy = policy
        self.what = what
        self.attempt = 1
        self.deadline: float | None = None  # monotonic time past which waiting ends; set by the first wait

    def should_wait(self, failed: Failed) -> bool:
        """True when ``failed`` calls for waiting (server down or full); raise a permanent failure's error."""
        if failed.trouble is Trouble.PERMANENT:
            raise failed.error
        if self.policy.waits and failed.trouble in (Trouble.DOWN, Trouble.FULL):
            if self.deadline is None:
                self.deadline = time.monotonic() + self.policy.wait_max_s
            return True
        return False

    def retry_delay_s(self, failed: Failed) -> float:
        """Seconds before the next attempt; raise ``InferenceUnavailable`` once the attempts are spent."""
        if self.attempt >= self.policy.max_attempts:
            raise InferenceUnavailable(f"{failed.error} (gave up after {self.attempt} attempts)") from None
        delay = self.policy.backoff_s(self.attempt - 1)
        if failed.retry_after_s is not None:
            delay = max(delay, min(failed.retry_after_s, self.policy.max_delay_s))
        log.warning("%s failed (%s); retry %d/%d in %.1fs", self.what, failed.error, self.attempt,
                    self.policy.max_attempts - 1, delay)
        self.attempt += 1
        return delay


def classify_status(status: int) -> Trouble | None:
    """None for a 2xx answer, else the kind of trouble the status means."""
    if 200 <= status < 300:
        return None
    if status == INSUFFICIENT_STORAGE:
        return Trouble.FULL
    if status >= 500 or status in TRANSIENT_STATUS:
        return Trouble.TRANSIENT
    return Trouble.PERMANENT


def classify_error(exc: httpx.TransportError) -> Trouble:
    """No connection at all (refused, unreachable, unresolved name) is *down*; anything mid-request is transient."""
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return Trouble.DOWN
    return Trouble.TRANSIENT


def retryable(exc: BaseException) -> bool:
    """Whether the same input can succeed later: only draftline errors that say they are not permanent."""
    return isinstance(exc, DraftlineError) and not exc.permanent


def retry_after_s(response: httpx.Response) -> float | None:
    """The server's ``Retry-After`` in seconds, when it sends one as a number."""
    try:
        value = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return value if value >= 0 else None


def health_url(base_url: str) -> str:
    return f"{server_root(base_url)}/health"


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def up_answer(status: int) -> bool:
    """A server that answers /health at all is up unless it says it is unhealthy (5xx): a server without
    the route (404) still takes requests, and the request itself then tells what is wrong."""
    return status < 500


class Outage:
    """One stretch of time the server is down or full: how long so far, when to log, when to give up."""

    def __init__(self, url: str | Sequence[str], what: str, reason: str, policy: RetryPolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        urls = [url] if isinstance(url, str) else list(url)
        self.url = ", ".join(urls)
        # One server "is down"; of several, every one is, or the request would have gone to another.
        self.where = f"inference server at {self.url}" if len(urls) == 1 else f"every inference server ({self.url})"
        self.what, self.reason, self.policy, self.clock = what, reason, policy, clock
        self.since = clock()
        self.checks = 0
        self._logged_at: float | None = None

    def elapsed_s(self) -> float:
        return self.clock() - self.since

    def pause_s(self, deadline: float | None = None) -> float:
        """Log (first call, then once a minute) and return how long to wait before the next check;
        raise ``InferenceUnavailable`` once ``deadline`` (a ``clock`` time) has passed."""
        now = self.clock()
        if deadline is not None and now >= deadline:
            raise self.gave_up()
        if self._logged_at is None:
            log.warning("%s %s (%s); waiting for it", self.where, self.what, self.reason)
            self._logged_at = now
        elif now - self._logged_at >= LOG_EVERY_S:
            log.warning("%s %s for %s; waiting", self.where, self.what, format_duration(self.elapsed_s()))
            self._logged_at = now
        delay = self.policy.backoff_s(self.checks)
        self.checks += 1
        return delay if deadline is None else max(0.0, min(delay, deadline - now))

    def recovered(self, url: str | None = None) -> None:
        """Log the end of the outage; ``url`` names the one server of several that came back."""
        where = f"inference server at {url}" if url else self.where
        log.info("%s is back after %s", where, format_duration(self.elapsed_s()))

    def gave_up(self) -> InferenceUnavailable:
        return InferenceUnavailable(
            f"{self.where} {self.what} for {format_duration(self.elapsed_s())} "
            f"({self.reason}); gave up waiting after {self.policy.wait_max_s:g}s ({WAIT_SETTING})"
        )


def wait_until_up(health: str, outage: Outage, deadline: float, *,
                  sleep: Callable[[float], object] = shutdown.wait) -> None:
    """Poll ``health`` with the outage's capped backoff until the server answers; raise past ``deadline``."""
    wait_until_any_up([health], outage, deadline, sleep=sleep)


def wait_until_any_up(healths: Sequence[str], outage: Outage, deadline: float, *,
                      sleep: Callable[[float], object] = shutdown.wait) -> int:
    """Poll every URL of ``healths`` with the outage's capped backoff until one answers; return its index.
    Raise ``InferenceUnavailable`` past ``deadline``, and ``JobYielded`` once the worker is told to stop (the
    default ``sleep`` ends at the request)."""
    while True:
        sleep(outage.pause_s(deadline))
        shutdown.check(f"waiting for {outage.where}, which {outage.what}")
        for index, health in enumerate(healths):
            try:
                up = up_answer(httpx.get(health, timeout=HEALTH_TIMEOUT_S, verify=tls_context()).status_code)
            except httpx.HTTPError:
                continue
            if up:
                outage.recovered(health.removesuffix("/health") if len(healths) > 1 else None)
                return index


class AsyncServerWatch:
    """One ``/health`` poller shared by a client's concurrent requests while every endpoint is down.

    Each waiting request keeps its own deadline; the poller itself runs until an endpoint answers (or the
    watch is closed), so a request that starts waiting late still learns promptly when one is back. The
    endpoint that answers is revived in ``pool``, so the next request goes to it. A waiting request looks at
    the worker's stop request every ``shutdown.POLL_S`` and raises ``JobYielded`` once it is made."""

    def __init__(self, pool: EndpointPool, policy: RetryPolicy) -> None:
        self.pool = pool
        self.policy = policy
        self._outage: Outage | None = None
        self._poller: asyncio.Task | None = None

    async def wait(self, reason: str, deadline: float) -> None:
        if self._poller is None or self._poller.done():
            self._outage = Outage(self.pool.urls, "is down", reason, self.policy)
            self._poller = asyncio.create_task(self._poll(self._outage))
        outage, poller = self._outage, self._poller
        while not poller.done():
            shutdown.check(f"waiting for {outage.where}, which {outage.what}")
            remaining = deadline - outage.clock()
            if remaining <= 0:
                raise outage.gave_up()
            # asyncio.wait leaves the poller running when it times out: other requests may be waiting on it.
            await asyncio.wait({poller}, timeout=min(remaining, shutdown.POLL_S))
        poller.result()  # the poller's own error, if it ended with one

    async def _poll(self, outage: Outage) -> None:
        async with httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S, verify=tls_context()) as http:
            while True:
                await asyncio.sleep(outage.pause_s())
                for url in self.pool.urls:
                    try:
                        response = await http.get(health_url(url))
                    except httpx.HTTPError:
                        continue
                    if up_answer(response.status_code):
                        outage.recovered(url if len(self.pool.urls) > 1 else None)
                        self.pool.revived(url)
                        return

    async def aclose(self) -> None:
        if self._poller is not None and not self._poller.done():
            self._poller.cancel()
            try:
                await self._poller
            except asyncio.CancelledError:
                pass


# How vLLM and SGLang word a prompt that does not fit; the built-in server says error.type "PromptTooLong".
_CONTEXT_REFUSALS = ("maximum context length", "longer than the maximum model length", "prompttoolong",
                     "exceeds the model's context", "context length")


def rejection(response: httpx.Response, message: str) -> DraftlineError:
    """The named error for a permanent 4xx: PromptTooLong for a context refusal, else InferenceRejected."""
    text = f"HTTP {response.status_code}: {message}"
    try:
        kind = str(response.json().get("error", {}).get("type", ""))
    except (ValueError, AttributeError):
        kind = ""
    if kind == "PromptTooLong" or any(phrase in message.lower() for phrase in _CONTEXT_REFUSALS):
        return PromptTooLong(text)
    return InferenceRejected(text)


MESSAGE_LIMIT = 500


def server_message(response: httpx.Response) -> str:
    """The error text a server sends: OpenAI ``{"error": {"message"}}``, FastAPI ``{"detail"}``, or the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:MESSAGE_LIMIT] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:MESSAGE_LIMIT]
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])[:MESSAGE_LIMIT]
    return str(body)[:MESSAGE_LIMIT]


def answer_trouble(response: httpx.Response, url: str) -> Failed | None:
    """None for a 2xx answer, else the attempt's trouble with the error naming ``url`` and the server's text."""
    trouble = classify_status(response.status_code)
    if trouble is None:
        return None
    message = server_message(response)
    if trouble is Trouble.PERMANENT:
        return Failed(trouble, rejection(response, message))
    error = InferenceUnavailable(f"{url}: HTTP {response.status_code}: {message}")
    return Failed(trouble, error, retry_after_s(response))


def transport_trouble(exc: httpx.TransportError, url: str) -> Failed:
    """The attempt's trouble when no answer came at all."""
    return Failed(classify_error(exc), InferenceUnavailable(f"{url}: {describe(exc)}"))


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The verifying TLS context every draftline HTTP client of this process shares. httpx builds one for
    each new client, even one that only speaks plain http, and loading the CA bundle costs 5-60 ms on a
    busy core: more than a whole loopback request. ``runtime.worker`` builds it before forking, so each
    job's process inherits it."""
    return httpx.create_ssl_context()


def preload_http() -> None:
    """Import what httpx loads only on a client's first request (httpcore, anyio's asyncio backend).

    A worker calls this before forking: otherwise every job's process imports them anew, which cost a
    generate job of 16 samples more CPU than its 16 requests (bench/RESULTS.md, the orchestration profile)."""
    import anyio._backends._asyncio  # noqa: F401 - anyio picks its backend by importing it on first use
    import certifi  # noqa: F401
    import httpcore  # noqa: F401
    import sniffio  # noqa: F401 - httpcore imports it on every request; a missing one is searched for each time


def post_json(url: str, body: dict, timeout: httpx.Timeout | float,
              headers: dict[str, str] | None = None, *, client: httpx.Client | None = None) -> httpx.Response | Failed:
    """One attempt: POST ``body``; the 2xx answer, or the attempt's trouble (no answer, or an error status).
    ``client`` keeps its connections open between attempts and requests; without one each call opens its own."""
    try:
        if client is None:
            response = httpx.post(url, json=body, timeout=timeout, verify=tls_context(), headers=headers)
        else:
            response = client.post(url, json=body, timeout=timeout, headers=headers)
    except httpx.TransportError as exc:
        return transport_trouble(exc, url)
    return answer_trouble(response, url) or response
