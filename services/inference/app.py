"""Assemble the FastAPI app: routes, error handlers, metrics, and the runtime started in the lifespan."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.inference.metrics import InferenceMetrics
from services.inference.model import LoadedModel, load_model
from services.inference.routes import chat, health, hidden_states, metrics
from services.inference.routes.errors import install_error_handlers
from services.inference.runtime import start_runtime
from runtime.body_limit import BodySizeLimit
from shared.settings import InferenceSettings

# A hidden-state request of a 128k-token sample is about 2 MiB of JSON; chat requests are smaller.
MAX_REQUEST_BYTES = 64 << 20


def create_app(settings: InferenceSettings, *, loaded: LoadedModel | None = None) -> FastAPI:
    """The inference app. The target loads (unless ``loaded`` is given) before the server accepts requests."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        model = loaded if loaded is not None else await run_in_threadpool(load_model, settings)
        app.state.runtime = start_runtime(settings, model, app.state.metrics)
        try:
            yield
        finally:
            await run_in_threadpool(app.state.runtime.stop)

    app = FastAPI(title="draftline inference", lifespan=lifespan)
    app.state.metrics = InferenceMetrics()
    install_error_handlers(app)
    app.add_middleware(ObserveRequests)
    app.add_middleware(BodySizeLimit, max_bytes=MAX_REQUEST_BYTES)
    for module in (health, metrics, chat, hidden_states):
        app.include_router(module.router)
    return app


class ObserveRequests:
    """Count and time every request under its route template (never the raw path, which is unbounded).

    Pure ASGI rather than ``BaseHTTPMiddleware``, which runs ``receive`` in a task group and so wraps
    the body-size refusal in an exception group that the error handlers would not recognise.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            # The router sets the matched route in the scope it shares with us.
            endpoint = getattr(scope.get("route"), "path", "unmatched")
            scope["app"].state.metrics.observe_request(endpoint, status, time.perf_counter() - started)
