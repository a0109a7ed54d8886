"""A test that needs a Debian package `make test` installs fails where it is missing, before its
fixtures start; it never skips. Checked by running a real test of the suite with an empty PATH."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.processes import REPO
from tests.support.system_packages import is_installed, missing_message


def run_suite_without_path(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": "", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], check=False,
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_a_test_needing_a_missing_package_errors_with_the_setup_command_before_its_fixtures_run():
    # Its module-scoped fixture would call promtool (None here) and die with a TypeError instead.
    result = run_suite_without_path("tests/test_compose.py", "-k", "test_promtool_accepts_each_layouts")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert missing_message("prometheus") in output
    assert "skipped" not in output and "TypeError" not in output
    assert " error" in output.splitlines()[-1]


def test_every_package_the_script_installs_has_a_check():
    script = (REPO / "tools" / "system-packages.sh").read_text()
    assert "KNOWN=(redis-server prometheus chromium)" in script
    for package in ("redis-server", "prometheus", "chromium"):
        assert isinstance(is_installed(package), bool)
    with pytest.raises(ValueError, match="unknown system package"):
        is_installed("redis")
