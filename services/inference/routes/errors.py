"""Errors as OpenAI-shaped JSON: ``{"error": {"message", "type", "param", "code"}}``.

A request the server refuses is a 4xx whose message says why; only a fault of the server is a 5xx.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.errors import DraftlineError

log = logging.getLogger(__name__)


class ApiError(Exception):
    """Raised by route code to answer with ``status`` and a message."""

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message


def error_response(status: int, error_type: str, message: str) -> JSONResponse:
    # A message may echo the client's text; a lone surrogate in it becomes its escape so the body encodes.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    body = {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def validation_message(errors: list[dict[str, Any]]) -> str:
    """``body.messages.0.role: Field required; …`` from pydantic's error list."""
    parts = []
    for err in errors:
        where = ".".join(str(loc) for loc in err.get("loc", ()))
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.error_type, exc.message)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(400, "BadRequestError", validation_message(list(exc.errors())))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # FastAPI refuses a body that does not parse (not UTF-8, nested too deep) with its own HTTPException.
    error_type = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
    return error_response(exc.status_code, error_type, str(exc.detail))


async def _draftline_error(request: Request, exc: DraftlineError) -> JSONResponse:
    # A permanent error is the request's fault; a transient one is worth retrying later.
    status = 400 if exc.permanent else 503
    return error_response(status, type(exc).__name__, str(exc))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(500, "InternalServerError", f"{type(exc).__name__}: {exc}")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(DraftlineError, _draftline_error)
    app.add_exception_handler(Exception, _unexpected)
