"""A FastAPI app served by uvicorn in a daemon thread on a free loopback port: the stand-in servers' lifecycle."""

from __future__ import annotations

import threading
import time
from typing import Self

import uvicorn
from fastapi import FastAPI

from tests.support.processes import free_port

START_TIMEOUT_S = 20


class ThreadServer:
    """Subclasses build their app in ``_app``; ``start``/``stop`` or ``with`` run it at ``url``."""

    name = "stand-in"

    def __init__(self) -> None:
        self.port = free_port()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _app(self) -> FastAPI:
        raise NotImplementedError

    def start(self) -> Self:
        # A reply still sleeping for a client that is gone (a killed worker's) must not hold up stop().
        config = uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=self.name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"{self.name} server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
