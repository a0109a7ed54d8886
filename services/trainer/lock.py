"""One trainer per run at a time: an exclusive ``flock`` on ``drafter/train.lock`` held for the whole job.

A reaper requeues a train job when its worker looks dead; a worker that only stalled (a long GC pause, a
network partition from Redis) may still be training. Two trainers on one run would interleave
checkpoints and log lines. The kernel drops the lock when its holder exits, however it exits (SIGKILL
included), so a crashed trainer never blocks the next one; Linux NFS clients carry ``flock`` to the server
as a POSIX lock, so the guard also holds between hosts sharing the volume.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shared.errors import DraftlineError
from shared.layout import RunPaths

LOCK_NAME = "train.lock"


class TrainingInProgress(DraftlineError):
    """Another trainer holds the run's lock; trying again after it finishes or dies can succeed."""

    permanent = False


def lock_path(paths: RunPaths) -> Path:
    return paths.drafter_dir / LOCK_NAME


@contextmanager
def exclusive_training(paths: RunPaths) -> Iterator[None]:
    """Hold the run's training lock, or raise TrainingInProgress at once (never wait behind a live trainer)."""
    path = lock_path(paths)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TrainingInProgress(f"run {paths.run!r} is being trained by another worker (lock {path} is held)") from None
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
