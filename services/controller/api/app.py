"""The controller's FastAPI application: routes, error mapping, and the supervisor thread's lifetime."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from services.controller.api.auth import RequireToken
from services.controller.api.routes import health, page, preflight, runs
from services.controller.loop.supervisor import supervise_forever
from runtime.body_limit import BodySizeLimit
from shared.settings import ControllerSettings

log = logging.getLogger(__name__)

SUPERVISOR_JOIN_S = 30.0
# Run requests name their datasets by path or hub id; no body carries data, so 1 MiB is generous.
MAX_REQUEST_BYTES = 1 << 20


def create_app(settings: ControllerSettings, conn: redis.Redis, *, supervise: bool = False) -> FastAPI:
    """The API over ``settings.data`` and ``conn``; with ``supervise`` the feed/hand-off loop runs alongside."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = threading.Event()
        thread = None
        if supervise:
            thread = threading.Thread(target=supervise_forever, args=(settings, conn, stop), name="supervisor",
                                      daemon=True)
            thread.start()
        yield
        stop.set()
        if thread is not None:
            thread.join(SUPERVISOR_JOIN_S)

    app = FastAPI(title="draftline controller", lifespan=lifespan)
    app.state.settings = settings
    app.state.conn = conn
    app.add_middleware(BodySizeLimit, max_bytes=MAX_REQUEST_BYTES)
    # Added last, so it runs first: a request without the token is refused before its body is read.
    app.add_middleware(RequireToken, settings=settings)
    app.include_router(health.router)
    app.include_router(runs.router)
    app.include_router(preflight.router)
    app.include_router(page.router)
    app.add_exception_handler(redis.RedisError, _redis_unavailable)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    return app


def _text(value: object) -> str:
    """``value`` as text that always encodes: a lone surrogate becomes its backslash escape."""
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")


def _error_entry(err: dict) -> dict:
    loc = [part if isinstance(part, int) else _text(part) for part in err.get("loc", ())]
    return {"type": _text(err.get("type", "")), "loc": loc, "msg": _text(err.get("msg", "invalid"))}


async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    # The offending input is left out: NaN, Infinity or a lone surrogate in it cannot be rendered as JSON.
    return JSONResponse(status_code=422, content={"detail": [_error_entry(err) for err in exc.errors()]})


async def _redis_unavailable(request: Request, exc: Exception) -> JSONResponse:
    log.warning("%s %s: redis unavailable: %s", request.method, request.url.path, exc)
    return JSONResponse(status_code=503, content={"detail": f"redis unavailable: {exc}"})
