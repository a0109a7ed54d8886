"""``draftline serve controller``: the HTTP API plus the supervisor loop that feeds and hands off runs."""

from __future__ import annotations

import uvicorn

from services.controller.app import create_app
from shared.queues import connect
from shared.settings import ControllerSettings, configure_logging, load_settings


def main() -> None:
    settings = load_settings(ControllerSettings)
    configure_logging(settings.log_level)
    app = create_app(settings, connect(settings.redis_url), supervise=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower())
