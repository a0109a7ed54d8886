"""OpenAI-compatible chat client for the generation server (built-in, vLLM or SGLang), over one endpoint or several.

What each kind of trouble costs follows ``runtime.retry`` and ``runtime.dispatch``: transient trouble
(timeouts, 5xx, 408, 429, a connection reset) fails over to another endpoint, else is retried with backoff
and then reported as ``InferenceUnavailable``; a server that is down (nothing listening, name not
resolved) fails over too, and when every endpoint is down or the disk is full (507) the request waits,
without spending attempts, up to the policy's wait cap; any other 4xx is the request's own fault and
becomes ``InferenceRejected`` carrying the server's message, sent to no other endpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from runtime.dispatch import Dispatcher, http_timeout
from shared.errors import DraftlineError
from runtime.retry import (
    Failed,
    RetryPolicy,
    answer_trouble,
    server_root,
    tls_context,
    transport_trouble,
)
from shared.runspec import GenerationConfig

log = logging.getLogger(__name__)

# No fixed delays: a client built without ``retry_delays_s`` follows its RetryPolicy.
RETRY_DELAYS_S: Sequence[float] | None = None


class MalformedCompletion(DraftlineError):
    """The server answered 200 with a body that is not a chat completion."""


@dataclass(frozen=True)
class Completion:
    content: str
    reasoning_content: str | None
    finish_reason: str | None
    model: str
    usage: dict = field(default_factory=dict)
    prompt_token_ids: list[int] | None = None  # the engine's own ids, where it returns them (return_token_ids)
    token_ids: list[int] | None = None

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
        # vLLM's extension, also the built-in server's: the ids the engine ran, so extraction re-tokenizes nothing.
        "return_token_ids": True,
    }


def token_ids_of(value: object, what: str) -> list[int] | None:
    """A list of token ids, or None where the server sent none; anything else is a malformed answer."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise MalformedCompletion(f"{what} is not a list of token ids: {str(value)[:200]}")
    return value


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
            prompt_token_ids=token_ids_of(body.get("prompt_token_ids"), "prompt_token_ids"),
            token_ids=token_ids_of(choice.get("token_ids"), "the choice's token_ids"),
        )
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise MalformedCompletion(f"not a chat completion ({type(exc).__name__}: {exc}): {str(body)[:200]}") from None


class ChatClient:
    """One client per job: a pooled connection set shared by the job's concurrent requests.

    ``base_url`` names one endpoint or several, comma-separated; ``start`` picks the endpoint the first
    request goes to (a job passes its first sample id). ``policy`` decides retries and waiting;
    ``retry_delays_s`` instead names fixed retry delays and turns waiting off (``RetryPolicy.fixed``).
    Without either the client uses ``RetryPolicy()``."""

    def __init__(self, base_url: str, *, timeout_s: float, max_connections: int,
                 retry_delays_s: Sequence[float] | None = RETRY_DELAYS_S, policy: RetryPolicy | None = None,
                 start: int | None = None) -> None:
        self.policy = policy or (RetryPolicy.fixed(retry_delays_s) if retry_delays_s is not None else RetryPolicy())
        self._dispatch = Dispatcher(base_url, self.policy, "chat request", start=start)
        self._http = httpx.AsyncClient(timeout=http_timeout(timeout_s), verify=tls_context(),
                                       limits=httpx.Limits(max_connections=max_connections))

    @property
    def endpoints(self) -> list[str]:
        return self._dispatch.pool.urls

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._dispatch.aclose()
        await self._http.aclose()

    async def complete(self, payload: dict, *, on_retry: Callable[[], object] | None = None) -> Completion:
        """Send one chat request until it succeeds, fails permanently, or runs out of attempts or patience;
        ``on_retry`` is called before each attempt after the first."""
        return await self._dispatch.asend(lambda url: self._once(url, payload), on_retry=on_retry)

    async def _once(self, root: str, payload: dict) -> Completion | Failed:
        url = chat_url(root)
        try:
            response = await self._http.post(url, json=payload)
        except httpx.TransportError as exc:
            return transport_trouble(exc, url)
        failed = answer_trouble(response, url)
        if failed is not None:
            return failed
        try:
            body = response.json()
        except ValueError:
            raise MalformedCompletion(f"response is not JSON: {response.text[:200]}") from None
        return parse_completion(body)
