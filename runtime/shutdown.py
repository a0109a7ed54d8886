"""A worker's stop request, as the job it runs sees it.

The first SIGTERM (or SIGINT) asks a worker to stop after its current job (RQ's warm shutdown). A job that is
working finishes; a job that is only *waiting* (for an inference server that is down, for room on a full volume,
for room in an online run's budget, for a training step's files) would keep its worker, and the container's grace
period, waiting with it. Such a job looks at the request wherever it waits and, once it is made, gives its
unfinished work back within ``DRAIN_DEADLINE_S``: it raises ``JobYielded``, the worker puts the job back at the
front of its queue (not counted as a retry or a lost execution) and exits. Samples the job had settled stay
settled; those it had not are the requeued job's, so nothing is lost and nothing is counted twice. A training job
yields at its next step boundary, after a checkpoint there (``services/trainer``).

The request reaches the job's own process: an inline worker (``runtime.inline_jobs``) runs the job in the process
that took the signal; a forking worker passes it to its work horse with ``HORSE_SIGNAL``, whose handler is
installed before the fork, so no horse ever sees that signal without it. Code that hands work on to processes
of its own (torchrun's ranks) forwards the request with ``forwarded``.

The request is made inside a signal handler, which runs in the main thread between two bytecodes, possibly while
that thread holds a lock (the one inside a ``threading.Event``, say): setting such an Event there can deadlock.
So the request is a plain flag that nothing locks, and every wait polls it (``wait``, ``asleep``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Iterator

from shared.errors import DraftlineError

log = logging.getLogger(__name__)

# A job that is only waiting gives its work back within this long of the stop request: every wait that looks at
# the request sleeps at most POLL_S between looks, and what follows a look (settling, requeueing) takes a moment.
DRAIN_DEADLINE_S = 10.0
POLL_S = 1.0
HORSE_SIGNAL = signal.SIGUSR1  # a forking worker's stop request to its work horse
_TICK_S = 0.1  # how often ``wait`` and ``asleep`` look at the flag: well within POLL_S, and cheap

_requested = False
# Appended and removed whole under the GIL; ``request`` iterates over a copy, so no lock is needed (nor allowed:
# see the module's docstring).
_forwards: list[Callable[[], None]] = []


class JobYielded(DraftlineError):
    """The worker was told to stop while the job waited (or, training, at a step boundary): the job gave its
    unfinished work back to its queue, to be run again from where it stood."""

    permanent = False


def request() -> None:
    """Ask this process's job to give its work back at its next wait; run every forward registered.

    Safe in a signal handler: it takes no lock. A forward runs there too, so it must be as safe (``os.kill``)."""
    global _requested
    first = not _requested
    _requested = True
    if first:
        log.info("stop requested: a waiting job gives its work back within %gs", DRAIN_DEADLINE_S)
    for forward in tuple(_forwards):
        try:
            forward()
        except Exception:  # noqa: BLE001 - a forward that fails must not keep the others from running
            log.exception("stop request: a forward failed")


def requested() -> bool:
    return _requested


def clear() -> None:
    """Forget a request (a forking worker before each fork, whose horse learns of a stop by signal; and tests)."""
    global _requested
    _requested = False


def wait(seconds: float) -> bool:
    """Sleep ``seconds``, or less when a stop is requested meanwhile; whether one was."""
    end = time.monotonic() + max(0.0, seconds)
    while not _requested:
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(left, _TICK_S))
    return True


async def asleep(seconds: float) -> bool:
    """``wait`` for a coroutine: sleep ``seconds`` without blocking the event loop, or less when a stop is
    requested meanwhile; whether one was."""
    end = time.monotonic() + max(0.0, seconds)
    while not _requested:
        left = end - time.monotonic()
        if left <= 0:
            return False
        await asyncio.sleep(min(left, _TICK_S))
    return True


def check(what: str) -> None:
    """Raise ``JobYielded`` naming ``what`` the job was doing, when a stop was requested."""
    if _requested:
        raise JobYielded(f"the worker was told to stop while {what}: the job's unfinished work goes back to its queue")


@contextlib.contextmanager
def forwarded(forward: Callable[[], None]) -> Iterator[None]:
    """Call ``forward`` when a stop is requested while the block runs (at once if one already was). A request
    that comes as the block starts may call it twice, so it must bear that (a second signal to the same process)."""
    _forwards.append(forward)
    try:
        if _requested:
            forward()
        yield
    finally:
        _forwards.remove(forward)


def install_horse_handler() -> None:
    """In a forking worker, before its first fork: ``HORSE_SIGNAL`` requests a stop in whichever process gets
    it (the worker passes it to its work horse, which inherits this handler through the fork)."""
    signal.signal(HORSE_SIGNAL, lambda signum, frame: request())
