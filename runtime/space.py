"""A write that finds the volume full waits for space instead of failing its run.

The projection (``runtime.disk``) pauses a run before its volume fills, but another process can fill it
anyway (a neighbour's job, a log, an operator's copy). Every writer of a run other than the extraction
(which waits through its claim and the server's 507) goes through ``write_with_space``: the write is
atomic (temp file, fsync, rename, so a failed attempt leaves nothing), and on ENOSPC or EDQUOT it is tried
again once free space has grown by ``retry_gain_bytes`` or ``retry_every_s`` has passed, with the run's
stage held (``SpaceHold``: ``runtime.disk.StageHold`` names it in the run's status) until the write lands.
Any other error is raised as before.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from runtime.disk import format_bytes, volume_usage

log = logging.getLogger(__name__)

T = TypeVar("T")
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})  # a quota is a full disk for the writer too
RETRY_GAIN_BYTES = 1 << 20
RETRY_EVERY_S = 60.0
POLL_S = 1.0
LOG_EVERY_S = 60.0


class SpaceHold(Protocol):
    """What a waiting writer tells the run: held with a reason, then released once its write landed."""

    def hold(self, reason: str) -> None: ...

    def release(self) -> None: ...


def no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS


def write_with_space(write: Callable[[], T], what: str, volume: Path, *, hold: SpaceHold | None = None,
                     poll_s: float = POLL_S, retry_every_s: float = RETRY_EVERY_S,
                     retry_gain_bytes: int = RETRY_GAIN_BYTES, log_every_s: float = LOG_EVERY_S) -> T:
    """``write()``'s result; while it fails for lack of space, wait for space and try again (``what`` names the
    write in the log and the hold's reason, ``volume`` is where free space is measured)."""
    waiting_since: float | None = None
    logged_at = 0.0
    while True:
        try:
            result = write()
        except OSError as exc:
            if not no_space(exc):
                raise
            free, _ = volume_usage(volume)
            now = time.monotonic()
            reason = (f"writing {what} found {volume} full ({format_bytes(free)} free: {exc.strerror or exc}); "
                      "free space or grow the volume, and the write goes on by itself")
            if waiting_since is None:
                waiting_since = now
            if hold is not None:
                hold.hold(reason)  # again each attempt: a Redis that lost the run gets it back
            if now - logged_at >= log_every_s:
                log.warning("%s (waiting %.0fs so far)", reason, now - waiting_since)
                logged_at = now
            _wait_for_space(volume, free, poll_s, retry_every_s, retry_gain_bytes)
            continue
        if waiting_since is not None:
            log.info("wrote %s after waiting %.0fs for disk space", what, time.monotonic() - waiting_since)
            if hold is not None:
                hold.release()
        return result


def _wait_for_space(volume: Path, free: int, poll_s: float, retry_every_s: float, gain: int) -> None:
    deadline = time.monotonic() + retry_every_s
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        if volume_usage(volume)[0] >= free + gain:
            return


def append_line(path: Path, line: str) -> None:
    """Append ``line`` and a newline to ``path`` whole or not at all: a write cut short (a full disk) is
    truncated back, so a log never keeps half a line; the error is raised."""
    data = (line + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)
