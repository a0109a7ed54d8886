"""Refuse request bodies over a size limit with 413, before they are buffered whole.

FastAPI reads a JSON body into memory in one piece; without a limit, one client's multi-gigabyte body
would exhaust the server that the whole pipeline shares. The limit applies to the declared
``Content-Length`` at once and to the bytes actually received (a chunked body declares none).

(FastAPI's own ``max_body_size`` answers a declared oversized body in plain text, bypassing the app's
error handlers; our clients parse every error body as JSON in the app's shape, so we refuse here.)
"""

from __future__ import annotations

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimit:
    """ASGI middleware: ``app.add_middleware(BodySizeLimit, max_bytes=…)``.

    The refusal is raised as FastAPI's ``HTTPException`` from inside ``receive``, so the route's body
    reading passes it on to the app's own exception handlers: the 413 comes back in the app's error shape.
    (Middleware between this one and the routes must not run ``receive`` in a task group, which would
    wrap the exception; the apps' middleware is pure ASGI for that reason.)
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            if declared is not None and declared > self.max_bytes:
                raise self._too_large(f"declares {declared} bytes")
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large(f"sent more than {self.max_bytes} bytes")
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self, what: str) -> HTTPException:
        return HTTPException(413, f"request body {what}; this server accepts at most {self.max_bytes} bytes")


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses a malformed length before the app sees the request
    return None
