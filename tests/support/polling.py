"""Wait for a condition the way a person watching would: poll it, and say what never came."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(check: Callable[[], T], what: str, timeout: float, interval: float = 1.0,
               detail: Callable[[], object] | None = None) -> T:
    """Poll ``check`` until it returns a true value, and return that; AssertionError naming ``what`` (and the
    last ``detail()``, if given) on time-out."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            extra = f": {detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{extra}")
        time.sleep(interval)
