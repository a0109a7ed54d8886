"""A full data volume: the hidden-state write answers 507, leaves nothing behind, and the server goes on.

The volume is a real size-limited tmpfs mounted for the test, filled until the next file cannot fit; a
real ``draftline serve inference`` process writes to it. Growing the mount lets the same request succeed.
"""

from __future__ import annotations

import httpx
import pytest

from shared.atomic import temp_files
from shared.hidden_file import verify_hidden_file
from tests.support.processes import ServiceProcess, free_port
from tests.support.tmpfs import mounted_tmpfs

HIDDEN = "/v1/hidden_states"
TOKENS = 200  # the tiny target (hidden 64, fp32) writes about 1 KiB per token: ~200 KiB per file
RELATIVE = "runs/full/hidden_states/rows_000000-001999/00000007.safetensors"


@pytest.fixture()
def volume(tmp_path):
    with mounted_tmpfs(tmp_path / "volume", 1 << 20) as fs:
        yield fs


@pytest.fixture()
def server(volume, tiny_model_dir, tmp_path):
    port = free_port()
    env = {"DRAFTLINE_MODEL_DIR": str(tiny_model_dir), "DRAFTLINE_DATA": str(volume.path),
           "DRAFTLINE_HOST": "127.0.0.1", "DRAFTLINE_PORT": str(port), "DRAFTLINE_DEVICE": "cpu",
           "DRAFTLINE_WRITER_THREADS": "2"}
    process = ServiceProcess("inference", env=env, log_dir=tmp_path / "logs",
                             health_url=f"http://127.0.0.1:{port}/health")
    with process:
        yield f"http://127.0.0.1:{port}", process


def hidden_body(path: str = RELATIVE) -> dict:
    ids = [3 + (i * 7) % 500 for i in range(TOKENS)]
    return {"input_ids": ids, "loss_mask": [i % 2 for i in range(TOKENS)], "path": path, "metadata": {"run": "full"}}


def test_a_full_volume_answers_507_writes_nothing_and_recovers_when_grown(server, volume):
    url, process = server
    volume.fill(leave=64 << 10)  # room for a temp file's start, never for the whole ~200 KiB

    for _ in range(2):  # twice: the first failure must not wedge the pipeline
        response = httpx.post(url + HIDDEN, json=hidden_body(), timeout=120)
        assert response.status_code == 507, response.text
        error = response.json()["error"]
        assert error["type"] == "InsufficientStorageError"
        assert str(volume.path) in error["message"] and "bytes free" in error["message"], error
        assert temp_files(volume.path) == []
        assert list(volume.path.rglob("*.safetensors")) == []

    # Every other request keeps working while the volume is full.
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 4, "temperature": 0}, timeout=120)
    assert chat.status_code == 200, chat.text
    bad = httpx.post(url + HIDDEN, json={**hidden_body(), "path": "../outside.safetensors"}, timeout=30)
    assert bad.status_code == 400  # request errors stay what they were

    volume.resize(4 << 20)
    response = httpx.post(url + HIDDEN, json=hidden_body(), timeout=120)
    assert response.status_code == 200, response.text
    written = response.json()
    info = verify_hidden_file(volume.path / RELATIVE, sha256=written["sha256"])
    assert info.num_tokens == TOKENS
    assert temp_files(volume.path) == []
    assert "no space left on the data volume" in process.full_log()
