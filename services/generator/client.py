"""OpenAI-compatible chat client for the generation server (built-in, vLLM or SGLang).

What each kind of trouble costs follows ``shared.retry``: transient trouble (timeouts, 5xx, 408, 429, a
connection reset) is retried with backoff and then reported as ``InferenceUnavailable``; a server that
is down (nothing listening, name not resolved) or full (507) is waited for, without spending attempts,
up to the policy's wait cap; any other 4xx is the request's own fault and becomes ``InferenceRejected``
carrying the server's message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from shared.errors import DraftlineError, InferenceUnavailable
from shared.retry import (
    AsyncServerWatch,
    Failed,
    Outage,
    Retrier,
    RetryPolicy,
    Trouble,
    classify_error,
    classify_status,
    describe,
    rejection,
    retry_after_s,
    server_root,
)
from shared.runspec import GenerationConfig

log = logging.getLogger(__name__)

# No fixed delays: a client built without ``retry_delays_s`` follows its RetryPolicy.
RETRY_DELAYS_S: Sequence[float] | None = None
MESSAGE_LIMIT = 500


class MalformedCompletion(DraftlineError):
    """The server answered 200 with a body that is not a chat completion."""


@dataclass(frozen=True)
class Completion:
    content: str
    reasoning_content: str | None
    finish_reason: str | None
    model: str
    usage: dict = field(default_factory=dict)

    @property
    def completion_tokens(self) -> int | None:
        value = self.usage.get("completion_tokens")
        return int(value) if isinstance(value, (int, float)) else None


def chat_url(base_url: str) -> str:
    """``…/v1/chat/completions`` whether the setting names the server root or its ``/v1``."""
    return f"{server_root(base_url)}/v1/chat/completions"


def chat_payload(model: str, messages: list[dict], generation: GenerationConfig, seed: int) -> dict:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": generation.max_tokens,
        "temperature": generation.temperature,
        "top_p": generation.top_p,
        "seed": seed,
    }


def parse_completion(body: object) -> Completion:
    """Read a chat completion; reasoning may sit in ``reasoning_content`` (vLLM, SGLang) or ``reasoning``."""
    try:
        choice = body["choices"][0]
        message = choice["message"]
        reasoning = message.get("reasoning_content") or message.get("reasoning") or None
        return Completion(
            content=message.get("content") or "",
            reasoning_content=reasoning,
            finish_reason=choice.get("finish_reason"),
            model=str(body.get("model", "")),
            usage=dict(body.get("usage") or {}),
        )
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise MalformedCompletion(f"not a chat completion ({type(exc).__name__}: {exc}): {str(body)[:200]}") from None


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


class ChatClient:
    """One client per job: a pooled connection set shared by the job's concurrent requests.

    ``policy`` decides retries and waiting; ``retry_delays_s`` instead names fixed retry delays and turns
    waiting off (``RetryPolicy.fixed``). Without either the client uses ``RetryPolicy()``."""

    def __init__(self, base_url: str, *, timeout_s: float, max_connections: int,
                 retry_delays_s: Sequence[float] | None = RETRY_DELAYS_S, policy: RetryPolicy | None = None) -> None:
        self.url = chat_url(base_url)
        self.server = server_root(base_url)
        self.policy = policy or (RetryPolicy.fixed(retry_delays_s) if retry_delays_s is not None else RetryPolicy())
        self._http = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=max_connections))
        self._watch = AsyncServerWatch(base_url, self.policy, self._http)
        self._full: Outage | None = None

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._watch.aclose()
        await self._http.aclose()

    async def complete(self, payload: dict) -> Completion:
        """Send one chat request until it succeeds, fails permanently, or runs out of attempts or patience."""
        retrier = Retrier(self.policy, "chat request")
        while True:
            result = await self._once(payload)
            if isinstance(result, Completion):
                return result
            if retrier.should_wait(result):
                await self._wait(result, retrier.deadline)
            else:
                await asyncio.sleep(retrier.retry_delay_s(result))

    async def _wait(self, failed: Failed, deadline: float) -> None:
        if failed.trouble is Trouble.DOWN:
            await self._watch.wait(str(failed.error), deadline)
            return
        self._full = self._full or Outage(self.server, "has no disk space", str(failed.error), self.policy)
        await asyncio.sleep(self._full.pause_s(deadline))

    async def _once(self, payload: dict) -> Completion | Failed:
        try:
            response = await self._http.post(self.url, json=payload)
        except httpx.TransportError as exc:
            return Failed(classify_error(exc), InferenceUnavailable(f"{self.url}: {describe(exc)}"))
        trouble = classify_status(response.status_code)
        if trouble is not Trouble.FULL and self._full is not None:
            self._full.recovered()
            self._full = None
        if trouble is Trouble.PERMANENT:
            return Failed(trouble, rejection(response, server_message(response)))
        if trouble is not None:
            error = InferenceUnavailable(f"{self.url}: HTTP {response.status_code}: {server_message(response)}")
            return Failed(trouble, error, retry_after_s(response))
        try:
            body = response.json()
        except ValueError:
            raise MalformedCompletion(f"response is not JSON: {response.text[:200]}") from None
        return parse_completion(body)
