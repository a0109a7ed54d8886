"""Processes that die with their parent (Linux ``PR_SET_PDEATHSIG``), so no work horse, torchrun or rank
outlives the process that started it and runs on beside a requeued copy of its job."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@functools.cache
def libc_prctl() -> Callable[..., int]:
    """libc's ``prctl``, resolved once: call this before forking, and a child between fork and exec (a
    ``preexec_fn``) then makes the call without taking the dynamic loader's locks."""
    return ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send this process ``sig`` when its parent ends (the request survives exec).

    Exits at once if the parent ended before the request took effect, since then no signal would come."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc_prctl()(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)
