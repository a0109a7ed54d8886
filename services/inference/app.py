"""Assemble the FastAPI app: routes, error handlers, metrics, and the runtime started in the lifespan."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from starlette.concurrency import run_in_threadpool

from services.inference.metrics import InferenceMetrics
from services.inference.model import LoadedModel, load_model
from services.inference.routes import chat, health, hidden_states, metrics
from services.inference.routes.errors import install_error_handlers
from services.inference.runtime import start_runtime
from shared.settings import InferenceSettings


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
    app.middleware("http")(_observe)
    for module in (health, metrics, chat, hidden_states):
        app.include_router(module.router)
    return app


async def _observe(request: Request, call_next) -> Response:
    """Count and time every request under its route template (never the raw path, which is unbounded)."""
    started = time.perf_counter()
    status = 500
    try:
        response = await call_next(request)
        status = response.status_code
        return response
    finally:
        route = request.scope.get("route")
        endpoint = getattr(route, "path", "unmatched")
        request.app.state.metrics.observe_request(endpoint, status, time.perf_counter() - started)
