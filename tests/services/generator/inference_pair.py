"""Two real built-in inference servers (``draftline serve inference``) for tests of workers over an endpoint list.

The tiny target here is untaught (random weights): these tests count requests and settled samples, never
what the replies say, so they skip the minutes of CPU teaching the session's ``tiny_model_dir`` costs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.inference.runtime import CHAT_ENDPOINT, HIDDEN_ENDPOINT
from tests.support.processes import ServiceProcess, free_port

__all__ = ["CHAT_ENDPOINT", "HIDDEN_ENDPOINT", "inference_pair", "served", "untaught_tiny", "wait_until"]


def untaught_tiny(directory: Path) -> Path:
    from services.cli.tiny_model import make_tiny_model

    return make_tiny_model(directory / "tiny", teach_steps=0)  # served as model "tiny"


@contextmanager
def inference_pair(model_dir: Path, data: Path, log_dir: Path) -> Iterator[list[tuple[ServiceProcess, str]]]:
    """Two inference processes on one model and one data volume, started together; (process, url) each."""
    servers = []
    for _ in range(2):
        port = free_port()
        env = {"DRAFTLINE_MODEL_DIR": str(model_dir), "DRAFTLINE_DATA": str(data), "DRAFTLINE_PORT": str(port),
               "DRAFTLINE_HOST": "127.0.0.1", "DRAFTLINE_DEVICE": "cpu"}
        url = f"http://127.0.0.1:{port}"
        servers.append((ServiceProcess("inference", env=env, log_dir=log_dir, health_url=f"{url}/health"), url))
    try:
        for process, _ in servers:  # both load the model at once, then each is waited for
            _start_without_waiting(process)
        for process, _ in servers:
            process.wait_healthy(300)
        yield servers
    finally:
        for process, _ in servers:
            process.stop()


def _start_without_waiting(process: ServiceProcess) -> None:
    health, process.health_url = process.health_url, None
    process.start()
    process.health_url = health


def served(url: str, route: str) -> int:
    """Requests ``route`` of the server at ``url`` answered with 200, by its own /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return int(sum(sample.value for family in text_string_to_metric_families(text)
                   if family.name == "draftline_inference_requests" for sample in family.samples
                   if sample.name.endswith("_total") and sample.labels.get("endpoint") == route
                   and sample.labels.get("status") == "200"))


def wait_until(condition, what: str, timeout_s: float, *processes: ServiceProcess) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` with the logs of ``processes``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        for process in processes:
            assert process.alive(), f"{process.name} exited while waiting for {what}:\n{process.log()}"
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s}s\n" + "\n".join(p.log() for p in processes))
        time.sleep(0.2)
