"""Where the suite's time goes besides the tests themselves: what each fixture's set-up cost, and how many tests
shared it (loaded by tests/conftest.py; `make test` prints the table after pytest's own ``--durations``).

A fixture is timed from its set-up hook's start to its end, so a fixture that requests another is charged
with the other's set-up too when that one is set up inside it (the table says "includes what it requests").
Under pytest-xdist each worker times its own set-ups and sends them to the controller with its results, so
a session fixture set up once per worker shows its count of set-ups beside the tests that used it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SHOWN = 15  # rows of the table
MIN_SECONDS = 1.0  # a fixture whose set-ups total less is not an expensive one
WORKER_KEY = "draftline_fixture_costs"  # where an xdist worker puts its timings for the controller


def fixture_key(fixturedef: pytest.FixtureDef) -> str:
    """``name (module where it is defined)``: fixtures of one name in several modules are several things."""
    return f"{fixturedef.argname} ({getattr(fixturedef.func, '__module__', '?')})"


@dataclass
class FixtureCost:
    scope: str
    setups: int = 0
    seconds: float = 0.0
    tests: set[str] = field(default_factory=set)

    def as_dict(self) -> dict:
        return {"scope": self.scope, "setups": self.setups, "seconds": self.seconds, "tests": sorted(self.tests)}


class FixtureCosts:
    """The plugin: times every fixture set-up, counts the tests whose fixtures include each."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.costs: dict[str, FixtureCost] = {}
        self.users: dict[str, set[str]] = {}  # fixture name -> the tests whose fixtures include it
        self.report_path = config.getoption("fixture_costs_json", None)

    def _cost(self, name: str, scope: str) -> FixtureCost:
        return self.costs.setdefault(name, FixtureCost(scope))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
        start = time.monotonic()
        yield
        cost = self._cost(fixture_key(fixturedef), fixturedef.scope)
        cost.setups += 1
        cost.seconds += time.monotonic() - start

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        info = getattr(item, "_fixtureinfo", None)
        for name in getattr(item, "fixturenames", ()):
            defs = info.name2fixturedefs.get(name) if info is not None else None
            if defs:  # the definition this test uses: the last one, the closest to it
                self.users.setdefault(fixture_key(defs[-1]), set()).add(item.nodeid)

    def collected(self) -> dict[str, dict]:
        """Each timed fixture's cost, with the tests that used it."""
        for name, cost in self.costs.items():
            cost.tests |= self.users.get(name, set())
        return {name: cost.as_dict() for name, cost in self.costs.items()}

    # ---- xdist: a worker sends its timings; the controller adds them up --------------------------------------
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput[WORKER_KEY] = json.dumps(self.collected())

    def pytest_testnodedown(self, node, error) -> None:
        raw = getattr(node, "workeroutput", {}).get(WORKER_KEY)
        if not raw:
            return
        for name, cost in json.loads(raw).items():
            mine = self._cost(name, cost["scope"])
            mine.setups += cost["setups"]
            mine.seconds += cost["seconds"]
            mine.tests |= set(cost["tests"])

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if hasattr(self.config, "workeroutput"):
            return
        rows = sorted(self.collected().items(), key=lambda kv: -kv[1]["seconds"])
        if self.report_path:
            Path(self.report_path).write_text(json.dumps(dict(rows), indent=1) + "\n")
        expensive = [(name, c) for name, c in rows if c["seconds"] >= MIN_SECONDS][:SHOWN]
        if not expensive:
            return
        terminalreporter.write_sep("=", f"slowest {len(expensive)} fixture set-ups (includes what each requests)")
        for name, cost in expensive:
            terminalreporter.write_line(
                f"{cost['seconds']:8.1f}s  {name}, {cost['scope']} scope: {cost['setups']} set-up(s), "
                f"{len(cost['tests'])} test(s)")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fixture-costs-json", dest="fixture_costs_json", default=None,
                     help="write every fixture's set-up time and the tests that used it to this JSON file")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(FixtureCosts(config), "draftline-fixture-costs")
