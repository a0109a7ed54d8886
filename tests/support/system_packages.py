"""The Debian packages the suite runs as programs. ``make test`` installs them first
(tools/system-packages.sh), so a test that needs one fails where it is missing, naming the package and
the command that installs it; it never skips.

Mark such a test ``@pytest.mark.needs_package("prometheus")``; tests/conftest.py checks the mark
before the test's fixtures start.
"""

from __future__ import annotations

import shutil

from tests.support.browser import chromium
from tests.support.prometheus import prometheus_binary

SETUP = "tools/system-packages.sh"

# What shows each package is installed: the commands the suite runs from it (as the script checks).
CHECKS = {
    "redis-server": lambda: shutil.which("redis-server") is not None,
    "prometheus": lambda: prometheus_binary() is not None and shutil.which("promtool") is not None,
    "chromium": lambda: chromium() is not None,
}


def is_installed(package: str) -> bool:
    if package not in CHECKS:
        raise ValueError(f"unknown system package {package!r} (known: {', '.join(CHECKS)})")
    return CHECKS[package]()


def missing_message(package: str) -> str:
    return (f"the Debian package {package} is not installed; `make test` installs it as root, "
            f"or run: sudo bash {SETUP} {package}")
