"""Headless Chromium (Debian's ``chromium``) for page tests: the DOM after scripts ran, or a screenshot."""

from __future__ import annotations

import shutil
import subprocess
import tempfile

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def dump_dom(url: str, *, timeout: float = 60.0) -> str:
    binary = chromium()
    if binary is None:
        raise RuntimeError("chromium is not installed; `make test` installs it as root, or run: sudo bash tools/system-packages.sh chromium")
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run([binary, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                                capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"chromium failed ({result.returncode}): {result.stderr[-2000:]}")
    return result.stdout


def screenshot(url: str, path: str, *, size: str = "1200,900", timeout: float = 60.0) -> None:
    binary = chromium()
    if binary is None:
        raise RuntimeError("chromium is not installed; `make test` installs it as root, or run: sudo bash tools/system-packages.sh chromium")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([binary, *FLAGS, f"--user-data-dir={profile}", f"--window-size={size}",
                        f"--screenshot={path}", url], capture_output=True, timeout=timeout, check=True)
