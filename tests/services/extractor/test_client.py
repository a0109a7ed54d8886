"""The hidden-states client against a real HTTP stand-in whose answers each test scripts."""

from __future__ import annotations

import logging
import threading

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.extractor.client import HiddenStatesClient
from shared.errors import InferenceRejected, InferenceUnavailable
from runtime.retry import RetryPolicy
from tests.support.openai_server import OpenAIServer
from tests.support.processes import free_port

NO_RETRIES = RetryPolicy(max_attempts=1, base_delay_s=0.02, max_delay_s=0.1, wait_max_s=30)
WRITTEN = {"path": "runs/r/hidden/00000000.safetensors", "num_tokens": 3, "shapes": {"hidden_states": [3, 192]},
           "dtype": "float32", "layer_ids": [1, 3, 5], "layer_convention": "hf_hidden_states",
           "sha256": "ab" * 32, "bytes": 4096}


class HiddenStandIn(OpenAIServer):
    """The scripted server plus ``POST /v1/hidden_states``: answers in order, the last one repeating."""

    def __init__(self, *answers: tuple[int, dict]) -> None:
        super().__init__()
        self.answers = list(answers)
        self.hidden_requests: list[dict] = []
        self.peers: set[tuple[str, int]] = set()  # the client's (host, port) of each request: its connections

    def _app(self) -> FastAPI:
        app = super()._app()

        @app.post("/v1/hidden_states")
        async def hidden(request: Request) -> JSONResponse:
            self.hidden_requests.append(await request.json())
            self.peers.add((request.client.host, request.client.port))
            status, body = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
            return JSONResponse(status_code=status, content=body)

        return app


def extract(url: str, policy: RetryPolicy):
    client = HiddenStatesClient(url, timeout_s=10, policy=policy)
    return client.extract(input_ids=[1, 2, 3], loss_mask=[0, 1, 1], path=WRITTEN["path"], layer_ids=None,
                          metadata={"run": "r", "sample_id": "0"})


def test_transient_answers_are_retried_then_named():
    policy = RetryPolicy(max_attempts=3, base_delay_s=0.02, max_delay_s=0.1, wait_max_s=30)
    with HiddenStandIn((503, {"detail": "warming up"}), (200, WRITTEN)) as server:
        assert extract(server.url, policy).sha256 == WRITTEN["sha256"]
        assert len(server.hidden_requests) == 2
    with HiddenStandIn((500, {"detail": "CUDA error"})) as server:
        with pytest.raises(InferenceUnavailable, match=r"HTTP 500: CUDA error \(gave up after 3 attempts\)"):
            extract(server.url, policy)
        assert len(server.hidden_requests) == 3


def test_a_rejected_request_is_sent_once():
    with HiddenStandIn((400, {"detail": "path outside the data volume"})) as server:
        with pytest.raises(InferenceRejected, match="path outside the data volume"):
            extract(server.url, NO_RETRIES)
        assert len(server.hidden_requests) == 1


def test_a_server_that_comes_up_late_is_waited_for_without_spending_attempts(caplog):
    caplog.set_level(logging.INFO, logger="runtime.retry")
    server = HiddenStandIn((200, WRITTEN))
    timer = threading.Timer(1.0, server.start)
    timer.start()
    try:
        assert extract(server.url + "/v1", NO_RETRIES).num_tokens == 3
    finally:
        timer.join()
        server.stop()
    assert server.health_checks == 1 and len(server.hidden_requests) == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"inference server at {server.url} is down (") and "ConnectError" in m for m in messages)
    assert any(m.startswith(f"inference server at {server.url} is back after") for m in messages)


def test_a_full_disk_507_is_waited_out_and_a_disk_that_stays_full_fails_at_the_cap():
    with HiddenStandIn((507, {"detail": "no space left"}), (507, {"detail": "no space left"}), (200, WRITTEN)) as server:
        assert extract(server.url, NO_RETRIES).bytes == 4096
        assert len(server.hidden_requests) == 3
    policy = RetryPolicy(max_attempts=1, base_delay_s=0.05, max_delay_s=0.1, wait_max_s=0.4)
    with HiddenStandIn((507, {"detail": "no space left"})) as server, \
            pytest.raises(InferenceUnavailable, match=r"has no disk space for 0s .*no space left.*gave up waiting"):
        extract(server.url, policy)


def test_waiting_for_a_down_server_ends_at_the_cap_and_is_off_with_fixed_delays():
    url = f"http://127.0.0.1:{free_port()}"
    policy = RetryPolicy(max_attempts=3, base_delay_s=0.05, max_delay_s=0.1, wait_max_s=0.5)
    with pytest.raises(InferenceUnavailable, match=r"is down for 0s \(.*ConnectError.*gave up waiting after 0.5s"):
        extract(url, policy)
    with pytest.raises(InferenceUnavailable, match=r"ConnectError.*gave up after 2 attempts"):
        extract(url, RetryPolicy.fixed((0.02,)))


def test_a_dead_endpoint_fails_over_to_the_next_and_a_rejection_goes_nowhere_else():
    dead = f"http://127.0.0.1:{free_port()}"
    with HiddenStandIn((200, WRITTEN)) as live:
        retries = []
        client = HiddenStatesClient(f"{dead},{live.url}/v1", timeout_s=10, policy=NO_RETRIES, start=0)
        result = client.extract(input_ids=[1, 2, 3], loss_mask=[0, 1, 1], path=WRITTEN["path"], layer_ids=None,
                                metadata={}, on_retry=lambda: retries.append(1))
        assert result.sha256 == WRITTEN["sha256"] and retries == [1] and len(live.hidden_requests) == 1
    with HiddenStandIn((400, {"detail": "path outside the data volume"})) as first, \
            HiddenStandIn((200, WRITTEN)) as second:
        client = HiddenStatesClient(f"{first.url},{second.url}", timeout_s=10, policy=NO_RETRIES, start=0)
        with pytest.raises(InferenceRejected, match="path outside the data volume"):
            client.extract(input_ids=[1], loss_mask=[1], path="../outside", layer_ids=None, metadata={})
        assert (len(first.hidden_requests), len(second.hidden_requests)) == (1, 0)


def test_one_client_sends_a_jobs_samples_over_one_kept_alive_connection_until_closed():
    with HiddenStandIn((200, WRITTEN)) as server:
        client = HiddenStatesClient(server.url, timeout_s=10, policy=NO_RETRIES)
        for sample_id in range(3):
            client.extract(input_ids=[1, 2, 3], loss_mask=[0, 1, 1], path=WRITTEN["path"], layer_ids=None,
                           metadata={"run": "r", "sample_id": str(sample_id)})
        client.close()
        assert len(server.hidden_requests) == 3 and len(server.peers) == 1
