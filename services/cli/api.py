"""Client of the controller's HTTP API, as ``draftline run --controller`` and ``make demo`` use it.

Every request carries the API token when one is given (``DRAFTLINE_API_TOKEN``), as
``Authorization: Bearer``. A refusal for want of it (401) or for a wrong one (403) is
``ControllerRefused`` with a message that says which setting to fix.
"""

from __future__ import annotations

import httpx

from shared.errors import DraftlineError

TOKEN_VARIABLE = "DRAFTLINE_API_TOKEN"


class ControllerRefused(DraftlineError):
    """The controller refused the request: no API token, a wrong one, or a request it does not accept."""

    def __init__(self, message: str, *, status: int, detail: object) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail


class ControllerUnreachable(DraftlineError):
    """Nothing answers at the controller's address."""

    permanent = False


class ControllerClient:
    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ControllerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, body: dict) -> dict:
        """``POST /runs``: the created run's spec."""
        return self._answer(self._send("POST", "/runs", json=body), expect=201)

    def retrain(self, source: str, body: dict) -> dict:
        """``POST /runs/<source>/retrain``: the new run's spec."""
        return self._answer(self._send("POST", f"/runs/{source}/retrain", json=body), expect=201)

    def run_status(self, run: str) -> dict:
        return self._answer(self._send("GET", f"/runs/{run}"), expect=200)

    def _send(self, method: str, path: str, **kwargs: object) -> httpx.Response:
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ControllerUnreachable(f"the controller at {self.url} does not answer: {type(exc).__name__}: "
                                        f"{exc}") from None

    def _answer(self, response: httpx.Response, *, expect: int) -> dict:
        if response.status_code == expect:
            return response.json()
        detail = _detail(response)
        where = f"the controller at {self.url}"
        if response.status_code == 401:
            message = f"{where} needs its API token: set {TOKEN_VARIABLE} to the controller's token ({detail})"
        elif response.status_code == 403 and "API token" in str(detail):
            message = f"{where} refused the API token: {TOKEN_VARIABLE} is not the controller's token ({detail})"
        else:
            message = f"{where} answered {response.status_code}: {detail}"
        raise ControllerRefused(message, status=response.status_code, detail=detail)


def _detail(response: httpx.Response) -> object:
    try:
        return response.json().get("detail", response.text)
    except (ValueError, AttributeError):
        return response.text[:500]
