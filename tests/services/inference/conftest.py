"""Fixtures for the inference tests: the tiny target loaded in-process (the reference), and one real
``draftline serve inference`` process shared by every server test in this folder."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.processes import ServiceProcess, free_port


@dataclass
class InferenceServer:
    url: str
    data: Path
    process: ServiceProcess

    def post(self, route: str, body: object, **kwargs) -> httpx.Response:
        return httpx.post(self.url + route, json=body, timeout=120, **kwargs)

    def get(self, route: str) -> httpx.Response:
        return httpx.get(self.url + route, timeout=30)


@pytest.fixture(scope="session")
def loaded_tiny(tiny_model_dir: Path):
    """The tiny target loaded through the server's own loader (fp32 on CPU): the in-process reference."""
    from services.inference.model import load_model
    from shared.settings import InferenceSettings

    return load_model(InferenceSettings(model_dir=tiny_model_dir, device="cpu"))


@pytest.fixture(scope="package")
def inference_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    data = tmp_path_factory.mktemp("volume")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        "DRAFTLINE_MODEL_DIR": str(tiny_model_dir),
        "DRAFTLINE_DATA": str(data),
        "DRAFTLINE_HOST": "127.0.0.1",
        "DRAFTLINE_PORT": str(port),
        "DRAFTLINE_DEVICE": "cpu",
        # A generous wait makes concurrent test requests reliably share a batch.
        "DRAFTLINE_BATCH_WAIT_MS": "300",
        "DRAFTLINE_MAX_BATCH_SIZE": "8",
        "DRAFTLINE_HIDDEN_BATCH_TOKENS": "256",
        "DRAFTLINE_WRITER_THREADS": "2",
    }
    process = ServiceProcess("inference", env=env, log_dir=tmp_path_factory.mktemp("logs"),
                             health_url=url + "/health")
    process.start()
    yield InferenceServer(url, data, process)
    process.stop()
    # uvicorn finishes its graceful shutdown, then re-raises SIGTERM, so -SIGTERM is a clean exit too.
    assert process.proc.returncode in (0, -signal.SIGTERM), process.log()
    assert "inference runtime stopped" in process.full_log(), process.log()
