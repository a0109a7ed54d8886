"""A worker's stop request (runtime.shutdown) made in the test's own process, and forgotten after the test."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from runtime import shutdown


@pytest.fixture()
def stop_in() -> Iterator[Callable[[float], None]]:
    """``stop_in(seconds)``: request a stop from another thread ``seconds`` from now, as a worker's first signal
    does while its job waits in the main thread; ``stop_in(0)`` requests it at once, before the wait."""
    timers: list[threading.Timer] = []

    def later(seconds: float) -> None:
        if seconds <= 0:
            shutdown.request()
            return
        timers.append(threading.Timer(seconds, shutdown.request))
        timers[-1].start()

    shutdown.clear()
    yield later
    for timer in timers:
        timer.cancel()
        timer.join()
    shutdown.clear()
