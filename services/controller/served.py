"""Ask the generation server which model it serves, for runs submitted without a model name."""

from __future__ import annotations

import httpx

from shared.errors import InferenceUnavailable

TIMEOUT_S = 10.0


def served_model(inference_url: str) -> str:
    """The first model ``/v1/models`` lists (vLLM, SGLang and the built-in server all answer it)."""
    url = f"{inference_url.rstrip('/')}/v1/models"
    try:
        response = httpx.get(url, timeout=TIMEOUT_S)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise InferenceUnavailable(
            f"the run names no model and {url} does not say which one it serves ({type(exc).__name__}: {exc})"
        ) from None
