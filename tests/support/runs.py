"""Waiting on a run of a LocalStack the way a user watches it: through the controller's API."""

from __future__ import annotations

import time

import httpx

from services.cli.stack import LocalStack
from shared.lifecycle import RunPhase


def wait_terminal(stack: LocalStack, run: str, timeout: float) -> dict:
    """The run's status once it ends; fails the test if a service died or the run outlasts ``timeout``."""
    deadline = time.monotonic() + timeout
    status: dict = {}
    while time.monotonic() < deadline:
        stack.check_alive()
        status = httpx.get(f"{stack.url('controller')}/runs/{run}", timeout=30).json()
        if RunPhase(status["state"]).terminal:
            return status
        time.sleep(1)
    raise AssertionError(f"run {run} did not finish in {timeout:.0f}s: {status}")


def status_or_none(stack: LocalStack, run: str) -> dict | None:
    """The run's status, or None while the controller does not answer (killed, restarting) or knows no such run."""
    try:
        response = httpx.get(f"{stack.url('controller')}/runs/{run}", timeout=10)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None
