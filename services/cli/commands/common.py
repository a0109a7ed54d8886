"""What several run commands share: the controller's settings, and which run a command means when none is named."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.settings import ControllerSettings


def controller_settings() -> ControllerSettings:
    """The settings the controller runs with: the run commands read and write what it does."""
    from shared.settings import ControllerSettings, load_settings

    return load_settings(ControllerSettings)


def pick_run(data: Path, run: str | None) -> str:
    """``run`` if given; else the only run, or the latest one (saying which runs exist)."""
    from shared.errors import RunNotFound
    from shared.layout import list_runs
    from shared.runspec import RunSpec

    if run:
        return run
    runs = list_runs(data)
    if not runs:
        raise RunNotFound(f"no runs under {Path(data) / 'runs'}")
    latest = max(runs, key=lambda name: RunSpec.load(data, name).created_at)
    if len(runs) > 1:
        sys.stderr.write(f"using the latest run, {latest} (runs: {', '.join(runs)}; name one to choose)\n")
    return latest
