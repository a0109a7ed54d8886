"""Who may call the controller: the API token (``DRAFTLINE_API_TOKEN``) and the listen-address rule.

With a token set, every mutating request (POST, PUT, PATCH, DELETE) must carry it, and with
``DRAFTLINE_API_READS=token`` every other request too; ``/health`` stays open for healthchecks. A request
without the token gets **401** (``WWW-Authenticate`` says how to send it), one with a wrong token **403**.
The check runs before routing and body parsing, so a caller without the token learns nothing else about
the request. Browsers cannot add a Bearer header to a page that refreshes itself, so for reads HTTP Basic
with the token as the password (any user name) counts too, and the status page's 401 asks the browser
for it. Mutating calls take Bearer only: a browser resends cached Basic credentials on its own, so
another site's page could otherwise make it submit runs.

Without a token the controller starts only on a loopback address, unless
``DRAFTLINE_ALLOW_UNAUTHENTICATED=true`` says the network in front of it is trusted.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import logging

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from shared.errors import SettingsError
from shared.settings import ControllerSettings

log = logging.getLogger(__name__)

MUTATING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
OPEN_PATHS = frozenset({"/health"})
# Paths a browser opens itself: their 401 asks for Basic credentials, which a browser can prompt for.
BROWSER_PATHS = frozenset({"/status"})
REALM = "draftline"


class Unauthenticated(SettingsError):
    """The controller would listen beyond loopback without an API token."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_listen_address(settings: ControllerSettings) -> None:
    """Refuse to serve an open API on an address other machines reach."""
    if settings.api_token is not None or is_loopback(settings.host):
        return
    if settings.allow_unauthenticated:
        log.warning("controller listens on %s without DRAFTLINE_API_TOKEN (DRAFTLINE_ALLOW_UNAUTHENTICATED=true): "
                    "anyone who reaches it can start runs", settings.host)
        return
    raise Unauthenticated(
        f"DRAFTLINE_HOST={settings.host} is not a loopback address and DRAFTLINE_API_TOKEN is not set: anyone who "
        "reaches the port could start runs. Set DRAFTLINE_API_TOKEN (at least 16 random characters), listen on "
        "127.0.0.1, or set DRAFTLINE_ALLOW_UNAUTHENTICATED=true if only trusted machines reach it."
    )


def needs_token(method: str, path: str, reads: str) -> bool:
    if path in OPEN_PATHS and method in ("GET", "HEAD"):
        return False
    return method in MUTATING_METHODS or reads == "token"


def presented_token(authorization: str, *, basic: bool) -> str | None:
    """The token of an ``Authorization`` header: Bearer, or (with ``basic``) the password of Basic; None
    when absent."""
    scheme, _, credentials = authorization.strip().partition(" ")
    credentials = credentials.strip()
    if scheme.lower() == "bearer" and credentials:
        return credentials
    if basic and scheme.lower() == "basic" and credentials:
        try:
            decoded = base64.b64decode(credentials, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2] or None
    return None


def token_matches(presented: str, expected: str) -> bool:
    # compare_digest takes as long for a near miss as for a wild guess.
    return hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))


class RequireToken:
    """ASGI middleware: answer 401/403 for a request that needs the token and lacks it."""

    def __init__(self, app: ASGIApp, *, settings: ControllerSettings) -> None:
        self.app = app
        self.token = settings.api_token.get_secret_value() if settings.api_token is not None else None
        self.reads = settings.api_reads

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.token is None or not needs_token(scope["method"], scope["path"], self.reads):
            await self.app(scope, receive, send)
            return
        headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]}
        presented = presented_token(headers.get("authorization", ""), basic=scope["method"] not in MUTATING_METHODS)
        if presented is not None and token_matches(presented, self.token):
            await self.app(scope, receive, send)
            return
        await self._refuse(scope, presented is None)(scope, receive, send)

    def _refuse(self, scope: Scope, missing: bool) -> JSONResponse:
        what = f"{scope['method']} {scope['path']}"
        if not missing:
            log.warning("%s: refused a wrong API token from %s", what, (scope.get("client") or ("?",))[0])
            return JSONResponse(status_code=403, content={
                "detail": f"{what}: the API token sent does not match the controller's DRAFTLINE_API_TOKEN"})
        scheme = "Basic" if scope["path"] in BROWSER_PATHS else "Bearer"
        return JSONResponse(status_code=401, headers={"WWW-Authenticate": f'{scheme} realm="{REALM}"'}, content={
            "detail": f"{what} needs the controller's API token: send 'Authorization: Bearer <DRAFTLINE_API_TOKEN>'"
                      + (" (Basic credentials count for reads only)" if scope["method"] in MUTATING_METHODS else "")})
