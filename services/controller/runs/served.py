"""Ask the generation server which model it serves, for runs submitted without a model name."""

from __future__ import annotations

import httpx

from shared.endpoints import parse_endpoints
from shared.errors import InferenceUnavailable

TIMEOUT_S = 10.0


def served_model(inference_url: str) -> str:
    """The first model ``/v1/models`` lists (vLLM, SGLang and the built-in server all answer it).

    ``inference_url`` may name several endpoints, comma-separated: the first that answers names the model
    (preflight checks that every endpoint serves the same one)."""
    urls, reasons = [], []
    for root in parse_endpoints(inference_url):
        url = f"{root}/v1/models"
        try:
            response = httpx.get(url, timeout=TIMEOUT_S)
            response.raise_for_status()
            return str(response.json()["data"][0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            urls.append(url)
            reasons.append(f"{type(exc).__name__}: {exc}")
    raise InferenceUnavailable(f"the run names no model and {' nor '.join(urls)} does not say which one it serves "
                               f"({'; '.join(reasons)})")
