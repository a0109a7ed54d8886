"""``draftline status --watch``: live progress bars, redrawn in place until the run ends or Ctrl-C."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from services.controller.runs.status import format_status
from shared.lifecycle import Outcome, RunPhase, Stage

BAR_WIDTH = 30
CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen


def bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    """``[#########.........]`` filled in proportion to done/total."""
    filled = round(width * done / total) if total else 0
    return "[" + "#" * min(filled, width) + "." * (width - min(filled, width)) + "]"


def render(status: dict) -> str:
    """One bar per stage above the operator text."""
    lines = []
    for stage in Stage:
        s = status["stages"][stage]
        done = s[Outcome.DONE]
        lines.append(f"{stage:<9} {bar(done, s['total'])} {done:>8,} / {s['total']:<8,} {s['percent']:5.1f}%")
    return "\n".join(lines) + "\n\n" + format_status(status)


def watch(fetch: Callable[[], dict], *, interval_s: float = 2.0, out: TextIO = sys.stdout,
          clear: bool = True) -> dict:
    """Redraw until the run reaches a terminal state; returns the last status."""
    while True:
        status = fetch()
        out.write((CLEAR if clear else "") + render(status) + "\n")
        out.flush()
        if RunPhase(status["state"]).terminal:
            return status
        time.sleep(interval_s)
