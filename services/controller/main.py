"""``draftline serve controller``: the HTTP API plus the supervisor loop that feeds and hands off runs."""

from __future__ import annotations

import threading

import uvicorn

from services.controller.api.app import create_app
from services.controller.api.auth import check_listen_address
from runtime.queues import connect
from shared.settings import ControllerSettings, configure_logging, load_settings
from runtime.volume import keep_claimed, try_claim


def main() -> None:
    settings = load_settings(ControllerSettings)
    configure_logging(settings.log_level)
    check_listen_address(settings)
    conn = connect(settings.redis_url)
    # Workers compare their data directory with this volume's identity before taking jobs.
    try_claim(settings.data, conn)
    threading.Thread(target=keep_claimed, args=(settings.data, conn, threading.Event()), name="volume-claim",
                     daemon=True).start()
    app = create_app(settings, conn, supervise=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower())
