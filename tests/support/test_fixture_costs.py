"""The fixture-cost table `make test` prints: each expensive fixture's set-up time, how often it was set up and
how many tests shared it, alone and under pytest-xdist (each worker's timings reach the controller)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import REPO

TESTS = '''
import time
import pytest

@pytest.fixture(scope="module")
def slow_stack():
    time.sleep(1.2)  # over the table's one-second floor

@pytest.fixture()
def quick():
    return 1

def test_one(slow_stack, quick):
    pass

def test_two(slow_stack):
    pass

def test_three(quick):
    pass
'''


def run_pytest(folder: Path, *args: str) -> tuple[str, dict]:
    report = folder / "costs.json"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.support.fixture_costs", "-p", "no:cacheprovider",
         "--fixture-costs-json", str(report), "-q", *args, "test_a.py", "test_b.py"],
        cwd=folder, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(report.read_text())


# Two modules of the same tests: under `--dist loadscope` each worker runs one, so the controller's table holds
# what both workers sent.
@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadscope"]], ids=["one process", "two xdist workers"])
def test_the_table_names_the_slow_fixture_its_set_ups_and_the_tests_that_shared_it(tmp_path, workers):
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / name).write_text(TESTS)
    out, costs = run_pytest(tmp_path, *workers)
    assert "slowest 2 fixture set-ups" in out
    # One name in two modules: two fixtures, each set up once for its module's two tests.
    for module in ("test_a", "test_b"):
        assert f"slow_stack ({module}), module scope: 1 set-up(s), 2 test(s)" in out
        slow = costs[f"slow_stack ({module})"]
        assert slow["seconds"] >= 1.2 and slow["tests"] == [f"{module}.py::test_one", f"{module}.py::test_two"]
        assert f"quick ({module})" not in out and len(costs[f"quick ({module})"]["tests"]) == 2  # too cheap to show
