"""The order modules start in: the longest first, from the seconds each took when last recorded.

`make test` runs the suite on several pytest-xdist workers, a whole module to a worker (``--dist loadscope``:
module fixtures such as a compose stack or a vLLM server are set up once). A worker takes the next module when
it finishes one, so a long module started last would leave the other workers idle while it runs; started
first, the short ones fill in around it (longest-processing-time-first scheduling). The seconds come from
``tests/module_seconds.json``, written by ``pytest --record-module-seconds`` (the sum of every test's set-up,
call and tear-down in the module). A module missing from it (a new one) starts after the recorded ones, in
collection order; a stale figure only makes the order less good, never a test's outcome different.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

RECORD = Path(__file__).resolve().parents[1] / "module_seconds.json"


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def recorded(path: Path = RECORD) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def longest_first(items: list[pytest.Item], seconds: dict[str, float]) -> list[pytest.Item]:
    """``items`` with whole modules reordered by their recorded seconds, longest first; each module's own
    order is kept, and unrecorded modules follow in the order they came."""
    order: dict[str, int] = {}
    for item in items:
        order.setdefault(module_of(item.nodeid), len(order))

    def key(item: pytest.Item) -> tuple[float, int]:
        module = module_of(item.nodeid)
        return (-seconds.get(module, -1.0), order[module])

    return sorted(items, key=key)  # stable: a module's tests keep their order


class ModuleSeconds:
    """With ``--record-module-seconds``: adds up every report's duration by module and writes RECORD at the end
(the modules this run ran replace their figures; the others keep theirs)."""

    def __init__(self, config: pytest.Config, path: Path = RECORD) -> None:
        self.config, self.path = config, path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[module_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(self.config, "workeroutput") or not self.seconds:
            return  # an xdist worker: its reports reach the controller, which records them
        merged = recorded(self.path) | {module: round(seconds, 1) for module, seconds in self.seconds.items()}
        ranked = dict(sorted(merged.items(), key=lambda kv: -kv[1]))
        self.path.write_text(json.dumps(ranked, indent=1) + "\n")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-module-seconds", action="store_true", default=False,
                     help=f"write each module's seconds to {RECORD.name}, which orders the modules of later runs")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("record_module_seconds"):
        config.pluginmanager.register(ModuleSeconds(config), "draftline-module-seconds")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = longest_first(items, recorded())
