"""Client of the built-in server's ``POST /v1/hidden_states``: it runs the target and writes the file.

The server writes the safetensors file itself (on the shared volume, at the path we name) and answers
with what it wrote, so hidden states never cross the network. Transient trouble is retried a few
times, then reported as ``InferenceUnavailable``; a 4xx is ``InferenceRejected`` with the server's
message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from shared.errors import DraftlineError, InferenceRejected, InferenceUnavailable

log = logging.getLogger(__name__)

RETRY_DELAYS_S = (0.5, 1.0, 2.0)
RETRYABLE_STATUS = {408, 429}
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
    base = base_url.rstrip("/")
    base = base[: -len("/v1")] if base.endswith("/v1") else base
    return f"{base}/v1/hidden_states"


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
    def __init__(self, base_url: str, *, timeout_s: float, retry_delays_s: Sequence[float] = RETRY_DELAYS_S) -> None:
        self.url = hidden_states_url(base_url)
        self.timeout_s = timeout_s
        self.retry_delays_s = tuple(retry_delays_s)

    def extract(self, *, input_ids: list[int], loss_mask: list[int], path: str, layer_ids: list[int] | None,
                metadata: dict[str, str]) -> HiddenStatesResult:
        body = {"input_ids": input_ids, "loss_mask": loss_mask, "path": path, "layer_ids": layer_ids,
                "metadata": metadata}
        attempts = len(self.retry_delays_s) + 1
        for attempt in range(attempts):
            try:
                return self._once(body)
            except InferenceUnavailable as exc:
                if attempt == attempts - 1:
                    raise InferenceUnavailable(f"{exc} (gave up after {attempts} attempts)") from None
                log.warning("hidden-states request failed (%s); retry %d/%d", exc, attempt + 1, attempts - 1)
                time.sleep(self.retry_delays_s[attempt])
        raise AssertionError("unreachable")

    def _once(self, body: dict) -> HiddenStatesResult:
        try:
            response = httpx.post(self.url, json=body, timeout=self.timeout_s)
        except httpx.TimeoutException as exc:
            raise InferenceUnavailable(f"{self.url}: timed out ({type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise InferenceUnavailable(f"{self.url}: {type(exc).__name__}: {exc}") from None
        if response.status_code >= 500 or response.status_code in RETRYABLE_STATUS:
            raise InferenceUnavailable(f"{self.url}: HTTP {response.status_code}: {_message(response)}")
        if response.status_code >= 400:
            raise InferenceRejected(f"HTTP {response.status_code}: {_message(response)}")
        try:
            return HiddenStatesResult.from_json(response.json())
        except ValueError:
            raise MalformedHiddenResponse(f"answer is not JSON: {response.text[:200]}") from None
