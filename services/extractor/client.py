"""Client of the built-in server's ``POST /v1/hidden_states``: it runs the target and writes the file.

The server writes the safetensors file itself (on the shared volume, at the path we name) and answers
with what it wrote, so hidden states never cross the network. ``base_url`` names one built-in server or
several, comma-separated. Trouble is handled as ``runtime.retry`` and ``runtime.dispatch`` say: transient
trouble or a down server fails over to another endpoint, else transient trouble is retried with backoff,
then reported as ``InferenceUnavailable``; when every endpoint is down, or the disk is full (507), the
request waits without spending attempts, up to the policy's wait cap; any other 4xx is
``InferenceRejected`` with the server's message, sent to no other endpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from runtime.dispatch import Dispatcher, http_timeout
from shared.errors import DraftlineError
from runtime.retry import Failed, RetryPolicy, post_json, server_root, tls_context

log = logging.getLogger(__name__)

# No fixed delays: a client built without ``retry_delays_s`` follows its RetryPolicy.
RETRY_DELAYS_S: Sequence[float] | None = None


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


class HiddenStatesClient:
    """``start`` picks the endpoint the first request goes to (a job passes its sample id, so consecutive
    samples go to consecutive endpoints). ``policy`` decides retries and waiting; ``retry_delays_s``
    instead names fixed retry delays and turns waiting off (``RetryPolicy.fixed``). Without either the
    client uses ``RetryPolicy()``.

    One client serves a job's samples over kept-alive connections (a new TCP connection per sample cost
    more than the loopback request itself); ``close`` ends them."""

    def __init__(self, base_url: str, *, timeout_s: float, retry_delays_s: Sequence[float] | None = RETRY_DELAYS_S,
                 policy: RetryPolicy | None = None, start: int | None = None) -> None:
        self.timeout = http_timeout(timeout_s)
        self.policy = policy or (RetryPolicy.fixed(retry_delays_s) if retry_delays_s is not None else RetryPolicy())
        self._dispatch = Dispatcher(base_url, self.policy, "hidden-states request", start=start)
        self._http = httpx.Client(timeout=self.timeout, verify=tls_context())

    def close(self) -> None:
        self._http.close()

    @property
    def endpoints(self) -> list[str]:
        return self._dispatch.pool.urls

    def extract(self, *, input_ids: list[int], loss_mask: list[int], path: str, layer_ids: list[int] | None,
                metadata: dict[str, str], storage: str = "target",
                on_retry: Callable[[], object] | None = None) -> HiddenStatesResult:
        """Ask for one file until it is written, the request fails permanently, or it runs out of attempts
        or patience; ``on_retry`` is called before each attempt after the first."""
        body = {"input_ids": input_ids, "loss_mask": loss_mask, "path": path, "layer_ids": layer_ids,
                "metadata": metadata, "storage": storage}
        return self._dispatch.send(lambda root: self._once(root, body), on_retry=on_retry)

    def _once(self, root: str, body: dict) -> HiddenStatesResult | Failed:
        response = post_json(hidden_states_url(root), body, self.timeout, client=self._http)
        if isinstance(response, Failed):
            return response
        try:
            return HiddenStatesResult.from_json(response.json())
        except ValueError:
            raise MalformedHiddenResponse(f"answer is not JSON: {response.text[:200]}") from None
