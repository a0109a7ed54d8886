"""The stand-in hidden-state server writes files the extractor's verification accepts, in both storages."""

from __future__ import annotations

import httpx
import pytest

from shared import eagle3
from shared.hidden_file import verify_hidden_file
from tests.support.hidden_server import HiddenStateServer


@pytest.mark.parametrize("storage", ["target", "fp8"])
def test_the_stand_in_writes_a_file_of_the_right_shapes_that_verifies(tmp_path, storage):
    body = {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "path": "runs/r/hidden_states/rows_0/0.safetensors",
            "layer_ids": None, "metadata": {"run": "r"}, "storage": storage}
    with HiddenStateServer(tmp_path, hidden_size=16, num_layers=8) as server:
        answer = httpx.post(f"{server.url}/v1/hidden_states", json=body, timeout=10).json()
    info = verify_hidden_file(tmp_path / body["path"], layer_ids=[1, 3, 4], sha256=answer["sha256"])
    assert (info.num_tokens, info.hidden_size, answer["shapes"][eagle3.AUX_HIDDEN]) == (3, 16, [3, 48])
    assert (info.dtype == eagle3.FP8_DTYPE) == (storage == "fp8") and answer["path"] == body["path"]


def test_the_stand_in_refuses_a_path_outside_the_runs_hidden_states(tmp_path):
    body = {"input_ids": [5], "loss_mask": [1], "path": "runs/r/run.json"}
    with HiddenStateServer(tmp_path) as server:
        response = httpx.post(f"{server.url}/v1/hidden_states", json=body, timeout=10)
    assert response.status_code == 400 and not (tmp_path / "runs").exists()
