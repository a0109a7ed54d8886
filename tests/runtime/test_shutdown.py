"""A worker's stop request as its job sees it (runtime.shutdown): waits end at the request, a look at it raises
JobYielded, the request made by a real signal while the main thread waits, forwards to the job's own children, and
the deadline the documentation states."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime import shutdown

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_request_left() -> Iterator[None]:
    """A request made here must not reach the tests that run after these in the same process."""
    shutdown.clear()
    yield
    shutdown.clear()


def test_a_wait_ends_when_a_stop_is_requested_from_another_thread_and_a_look_then_yields():
    threading.Timer(0.2, shutdown.request).start()
    assert shutdown.wait(60) is True
    with pytest.raises(shutdown.JobYielded, match="while waiting for the test: the job's unfinished work goes back"):
        shutdown.check("waiting for the test")


def test_without_a_request_a_wait_sleeps_its_time_out_and_a_look_passes():
    assert shutdown.wait(0.05) is False and shutdown.requested() is False
    shutdown.check("waiting for nothing")


def test_a_yield_is_a_draftline_error_that_is_not_permanent():
    assert not shutdown.JobYielded("x").permanent


def test_the_horse_signal_ends_a_wait_of_the_main_thread_that_took_it():
    """The request is made inside a signal handler, in the main thread, which is itself in the wait: the wait must
    notice it rather than deadlock on a lock it holds."""
    previous = signal.getsignal(shutdown.HORSE_SIGNAL)
    shutdown.install_horse_handler()
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), shutdown.HORSE_SIGNAL)).start()
        assert shutdown.wait(60) is True
    finally:
        signal.signal(shutdown.HORSE_SIGNAL, previous)
    assert shutdown.requested()


def test_an_asynchronous_sleep_ends_when_a_stop_is_requested():
    async def main() -> bool:
        asyncio.get_running_loop().call_later(0.2, shutdown.request)
        return await shutdown.asleep(60)

    assert asyncio.run(main()) is True
    assert asyncio.run(shutdown.asleep(0.01)) is True  # the request stays until cleared


def test_a_forward_is_called_for_a_request_made_while_its_block_runs_and_at_once_for_one_made_before():
    calls: list[str] = []
    with shutdown.forwarded(lambda: calls.append("during")):
        assert calls == []
        shutdown.request()
    assert calls == ["during"]
    shutdown.request()  # after the block: no longer forwarded
    assert calls == ["during"]
    with shutdown.forwarded(lambda: calls.append("before")):
        pass
    assert calls == ["during", "before"]


def test_a_failing_forward_does_not_keep_the_others_from_running():
    calls: list[str] = []

    def broken() -> None:
        raise RuntimeError("forward failed")

    with shutdown.forwarded(broken), shutdown.forwarded(lambda: calls.append("still called")):
        shutdown.request()
    assert calls == ["still called"]


def test_the_readme_and_the_architecture_map_state_the_deadline_the_code_keeps():
    stated = f"within {shutdown.DRAIN_DEADLINE_S:g} s"
    for doc in ("README.md", "docs/architecture.md"):
        assert stated in (REPO / doc).read_text(encoding="utf-8"), doc
