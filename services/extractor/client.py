"""Client of the built-in server's ``POST /v1/hidden_states``: it runs the target and writes the file.

The server writes the safetensors file itself (on the shared volume, at the path we name) and answers
with what it wrote, so hidden states never cross the network. Trouble is handled as ``shared.retry``
says: transient trouble is retried with backoff, then reported as ``InferenceUnavailable``; a server that
is down or full (507) is waited for without spending attempts, up to the policy's wait cap; any other
4xx is ``InferenceRejected`` with the server's message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from shared.errors import DraftlineError, InferenceUnavailable
from shared.retry import (
    Failed,
    Outage,
    Retrier,
    RetryPolicy,
    Trouble,
    classify_error,
    classify_status,
    describe,
    health_url,
    rejection,
    retry_after_s,
    server_root,
    wait_until_up,
)

log = logging.getLogger(__name__)

# No fixed delays: a client built without ``retry_delays_s`` follows its RetryPolicy.
RETRY_DELAYS_S: Sequence[float] | None = None
MESSAGE_LIMIT = 500


class MalformedHiddenResponse(DraftlineError):
    """The server answered 200 with a body that does not describe a written file."""


@dataclass(frozen=True)
class HiddenStatesResult:
    path: str
    num_tokens: int
    shapes: dict[str, list[int]]
    dtype: str
    layer_ids: list[int]
    layer_convention: str
    sha256: str
    bytes: int

    @classmethod
    def from_json(cls, body: object) -> HiddenStatesResult:
        try:
            return cls(
                path=str(body["path"]), num_tokens=int(body["num_tokens"]), shapes=dict(body["shapes"]),
                dtype=str(body["dtype"]), layer_ids=[int(x) for x in body["layer_ids"]],
                layer_convention=str(body["layer_convention"]), sha256=str(body["sha256"]), bytes=int(body["bytes"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedHiddenResponse(f"hidden-states answer lacks {exc}: {str(body)[:200]}") from None


def hidden_states_url(base_url: str) -> str:
    return f"{server_root(base_url)}/v1/hidden_states"


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:MESSAGE_LIMIT]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:MESSAGE_LIMIT]
        if body.get("detail"):
            return str(body["detail"])[:MESSAGE_LIMIT]
    return str(body)[:MESSAGE_LIMIT]


class HiddenStatesClient:
    """``policy`` decides retries and waiting; ``retry_delays_s`` instead names fixed retry delays and turns
    waiting off (``RetryPolicy.fixed``). Without either the client uses ``RetryPolicy()``."""

    def __init__(self, base_url: str, *, timeout_s: float, retry_delays_s: Sequence[float] | None = RETRY_DELAYS_S,
                 policy: RetryPolicy | None = None) -> None:
        self.url = hidden_states_url(base_url)
        self.server = server_root(base_url)
        self.health = health_url(base_url)
        self.timeout_s = timeout_s
        self.policy = policy or (RetryPolicy.fixed(retry_delays_s) if retry_delays_s is not None else RetryPolicy())

    def extract(self, *, input_ids: list[int], loss_mask: list[int], path: str, layer_ids: list[int] | None,
                metadata: dict[str, str]) -> HiddenStatesResult:
        body = {"input_ids": input_ids, "loss_mask": loss_mask, "path": path, "layer_ids": layer_ids,
                "metadata": metadata}
        retrier, full = Retrier(self.policy, "hidden-states request"), None
        while True:
            result = self._once(body)
            if full is not None and not (isinstance(result, Failed) and result.trouble is Trouble.FULL):
                full.recovered()
                full = None
            if isinstance(result, HiddenStatesResult):
                return result
            if not retrier.should_wait(result):
                time.sleep(retrier.retry_delay_s(result))
            elif result.trouble is Trouble.DOWN:
                wait_until_up(self.health, Outage(self.server, "is down", str(result.error), self.policy),
                              retrier.deadline)
            else:
                full = full or Outage(self.server, "has no disk space", str(result.error), self.policy)
                time.sleep(full.pause_s(retrier.deadline))

    def _once(self, body: dict) -> HiddenStatesResult | Failed:
        try:
            response = httpx.post(self.url, json=body, timeout=self.timeout_s)
        except httpx.TransportError as exc:
            return Failed(classify_error(exc), InferenceUnavailable(f"{self.url}: {describe(exc)}"))
        trouble = classify_status(response.status_code)
        if trouble is Trouble.PERMANENT:
            return Failed(trouble, rejection(response, _message(response)))
        if trouble is not None:
            error = InferenceUnavailable(f"{self.url}: HTTP {response.status_code}: {_message(response)}")
            return Failed(trouble, error, retry_after_s(response))
        try:
            return HiddenStatesResult.from_json(response.json())
        except ValueError:
            raise MalformedHiddenResponse(f"answer is not JSON: {response.text[:200]}") from None
