"""OpenAI-compatible chat client for the generation server (built-in, vLLM or SGLang).

Transient trouble (no connection, timeouts, 5xx, 408, 429) is retried with backoff and then reported as
``InferenceUnavailable``; any other 4xx is the request's own fault and becomes ``InferenceRejected``
carrying the server's message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from shared.errors import DraftlineError, InferenceRejected, InferenceUnavailable
from shared.runspec import GenerationConfig

log = logging.getLogger(__name__)

RETRY_DELAYS_S = (0.5, 1.0, 2.0)
RETRYABLE_STATUS = {408, 429}
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
    base = base_url.rstrip("/")
    base = base[: -len("/v1")] if base.endswith("/v1") else base
    return f"{base}/v1/chat/completions"


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
    """One client per job: a pooled connection set shared by the job's concurrent requests."""

    def __init__(self, base_url: str, *, timeout_s: float, max_connections: int,
                 retry_delays_s: Sequence[float] = RETRY_DELAYS_S) -> None:
        self.url = chat_url(base_url)
        self.retry_delays_s = tuple(retry_delays_s)
        self._http = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=max_connections))

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def complete(self, payload: dict) -> Completion:
        attempts = len(self.retry_delays_s) + 1
        for attempt in range(attempts):
            try:
                return await self._once(payload)
            except InferenceUnavailable as exc:
                if attempt == attempts - 1:
                    raise InferenceUnavailable(f"{exc} (gave up after {attempts} attempts)") from None
                delay = self.retry_delays_s[attempt]
                log.warning("chat request failed (%s); retry %d/%d in %.1fs", exc, attempt + 1, attempts - 1, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _once(self, payload: dict) -> Completion:
        try:
            response = await self._http.post(self.url, json=payload)
        except httpx.TimeoutException as exc:
            raise InferenceUnavailable(f"{self.url}: timed out ({type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise InferenceUnavailable(f"{self.url}: {type(exc).__name__}: {exc}") from None
        if response.status_code >= 500 or response.status_code in RETRYABLE_STATUS:
            raise InferenceUnavailable(f"{self.url}: HTTP {response.status_code}: {server_message(response)}")
        if response.status_code >= 400:
            raise InferenceRejected(f"HTTP {response.status_code}: {server_message(response)}")
        try:
            body = response.json()
        except ValueError:
            raise MalformedCompletion(f"response is not JSON: {response.text[:200]}") from None
        return parse_completion(body)
