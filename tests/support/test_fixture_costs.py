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
    assert "slowest 1 fixture set-ups" in out
    assert "slow_stack (module): 2 set-up(s), 4 test(s)" in out
    assert costs["slow_stack"]["seconds"] >= 2.4 and costs["slow_stack"]["tests"] == [
        f"{module}::{test}" for module in ("test_a.py", "test_b.py") for test in ("test_one", "test_two")]
    assert "quick" not in out and len(costs["quick"]["tests"]) == 4  # recorded, too cheap for the table
