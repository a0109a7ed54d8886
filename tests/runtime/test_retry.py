"""Retry policy, the classification of trouble, and waiting for a down server, against real sockets."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from shared.errors import (
    InferenceRejected,
    InferenceUnavailable,
    PromptTooLong,
    ReplyTooShort,
    RowError,
    error_class,
)
from runtime import shutdown
from runtime.endpoint_pool import EndpointPool
from runtime.retry import (
    AsyncServerWatch,
    Failed,
    Outage,
    Retrier,
    RetryPolicy,
    Trouble,
    classify_error,
    classify_status,
    health_url,
    retryable,
    wait_until_up,
)
from shared.settings import ExtractorSettings, GeneratorSettings, RetrySettings
from tests.support.openai_server import OpenAIServer
from tests.support.processes import free_port
from tests.support.stopping import stop_in  # noqa: F401 - a fixture


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_to_the_cap_and_full_jitter_draws_below_it():
    policy = RetryPolicy(base_delay_s=1.0, max_delay_s=30.0)
    assert [policy.backoff_s(n, rand=lambda: 1.0) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert policy.backoff_s(3, rand=lambda: 0.25) == 2.0
    assert policy.backoff_s(500, rand=lambda: 1.0) == 30.0  # no overflow on a very long outage
    assert RetryPolicy(jitter=False).backoff_s(2, rand=lambda: 0.0) == 4.0


def test_fixed_delays_are_reproduced_and_turn_waiting_off():
    policy = RetryPolicy.fixed((0.5, 1.0, 2.0))
    assert policy.max_attempts == 4 and not policy.waits
    assert [policy.backoff_s(n) for n in range(3)] == [0.5, 1.0, 2.0]
    assert RetryPolicy.fixed(()).max_attempts == 1


def test_policy_from_settings_and_its_defaults_are_the_settings_defaults(tmp_path):
    assert RetryPolicy.from_settings(RetrySettings()) == RetryPolicy()
    settings = GeneratorSettings(retry_max_attempts=2, retry_base_delay_s=0.1, retry_max_delay_s=3,
                                 inference_wait_max_s=0)
    assert RetryPolicy.from_settings(settings) == RetryPolicy(2, 0.1, 3.0, True, 0.0)
    extractor = ExtractorSettings(model_dir=tmp_path, inference_wait_max_s=60)
    assert RetryPolicy.from_settings(extractor).wait_max_s == 60


def test_environment_sets_the_retry_settings(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DRAFTLINE_RETRY_MAX_ATTEMPTS", "7")
    monkeypatch.setenv("DRAFTLINE_RETRY_BASE_DELAY_S", "0.25")
    monkeypatch.setenv("DRAFTLINE_RETRY_MAX_DELAY_S", "9")
    monkeypatch.setenv("DRAFTLINE_INFERENCE_WAIT_MAX_S", "120")
    assert RetryPolicy.from_settings(GeneratorSettings()) == RetryPolicy(7, 0.25, 9.0, True, 120.0)


@pytest.mark.parametrize(("status", "trouble"), [
    (200, None), (204, None),
    (400, Trouble.PERMANENT), (401, Trouble.PERMANENT), (404, Trouble.PERMANENT), (413, Trouble.PERMANENT),
    (422, Trouble.PERMANENT),
    (408, Trouble.TRANSIENT), (429, Trouble.TRANSIENT), (500, Trouble.TRANSIENT), (502, Trouble.TRANSIENT),
    (503, Trouble.TRANSIENT), (504, Trouble.TRANSIENT),
    (507, Trouble.FULL),
])
def test_status_classification(status, trouble):
    assert classify_status(status) is trouble


def error_of(url: str, timeout: float = 5.0) -> httpx.TransportError:
    with pytest.raises(httpx.TransportError) as caught:
        httpx.get(url, timeout=timeout)
    return caught.value


def test_no_connection_or_no_name_is_down():
    refused = error_of(f"http://127.0.0.1:{free_port()}/health")
    unresolved = error_of("http://draftline-no-such-host.invalid:8000/health")
    assert (classify_error(refused), classify_error(unresolved)) == (Trouble.DOWN, Trouble.DOWN)


def one_shot_server(behaviour) -> tuple[int, threading.Thread]:
    """A raw TCP server that accepts one connection, reads the request, then does ``behaviour(conn)``."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                behaviour(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return port, thread


def test_a_reset_or_a_timeout_mid_request_is_transient():
    port, thread = one_shot_server(lambda conn: None)  # read the request, close without an answer
    reset = error_of(f"http://127.0.0.1:{port}/v1/chat/completions")
    thread.join(5)
    stop = threading.Event()
    port, thread = one_shot_server(lambda conn: stop.wait(10))  # read it, never answer
    slow = error_of(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=0.5)
    stop.set()
    thread.join(5)
    assert isinstance(slow, httpx.ReadTimeout)
    assert (classify_error(reset), classify_error(slow)) == (Trouble.TRANSIENT, Trouble.TRANSIENT)


def test_only_errors_that_say_so_are_retryable():
    assert retryable(InferenceUnavailable("down"))
    for permanent in (InferenceRejected("400"), PromptTooLong("long"), RowError("bad row"), ReplyTooShort("short"),
                      ValueError("bug")):
        assert not retryable(permanent), error_class(permanent)


def test_retrier_spends_attempts_on_transient_trouble_only():
    retrier = Retrier(RetryPolicy(max_attempts=2, base_delay_s=0.1, max_delay_s=1.0, jitter=False, wait_max_s=60))
    with pytest.raises(InferenceRejected):
        retrier.should_wait(Failed(Trouble.PERMANENT, InferenceRejected("HTTP 400: too long")))
    for _ in range(3):  # waiting for a down or full server is free
        assert retrier.should_wait(Failed(Trouble.DOWN, InferenceUnavailable("refused")))
        assert retrier.should_wait(Failed(Trouble.FULL, InferenceUnavailable("507")))
    transient = Failed(Trouble.TRANSIENT, InferenceUnavailable("HTTP 503: busy"), retry_after_s=0.5)
    assert not retrier.should_wait(transient)
    assert retrier.retry_delay_s(transient) == 0.5  # the server's Retry-After beats a shorter backoff
    with pytest.raises(InferenceUnavailable, match=r"HTTP 503: busy \(gave up after 2 attempts\)"):
        retrier.retry_delay_s(transient)


def test_retrier_without_waiting_treats_a_down_server_as_transient():
    retrier = Retrier(RetryPolicy.fixed((0.1,)))
    assert not retrier.should_wait(Failed(Trouble.DOWN, InferenceUnavailable("refused")))
    assert retrier.retry_delay_s(Failed(Trouble.DOWN, InferenceUnavailable("refused"))) == 0.1


def test_outage_logs_once_a_minute_and_gives_up_at_its_deadline(caplog):
    clock = FakeClock()
    policy = RetryPolicy(base_delay_s=1.0, max_delay_s=30.0, jitter=False, wait_max_s=600)
    outage = Outage("http://inference:8000", "is down", "ConnectError: refused", policy, clock=clock)
    deadline = clock.now + policy.wait_max_s
    caplog.set_level(logging.WARNING, logger="runtime.retry")
    delays = []
    with pytest.raises(InferenceUnavailable) as gave_up:
        for _ in range(100):
            delays.append(outage.pause_s(deadline))
            clock.now += delays[-1]
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "inference server at http://inference:8000 is down (ConnectError: refused); waiting for it"
    assert "inference server at http://inference:8000 is down for 3m; waiting" in lines
    assert 9 <= len(lines) <= 11  # ten minutes of waiting: one line a minute, not one per poll
    assert len(delays) > len(lines)
    assert max(delays) == 30.0 and sum(delays) == pytest.approx(600)
    assert "is down for 10m (ConnectError: refused); gave up waiting after 600s (DRAFTLINE_INFERENCE_WAIT_MAX_S)" \
        in str(gave_up.value)


def test_wait_until_up_polls_health_until_the_server_answers():
    server = OpenAIServer()
    policy = RetryPolicy(base_delay_s=0.05, max_delay_s=0.2, wait_max_s=60)
    outage = Outage(server.url, "is down", "refused", policy)
    timer = threading.Timer(0.5, server.start)
    timer.start()
    try:
        wait_until_up(health_url(server.url + "/v1"), outage, outage.clock() + policy.wait_max_s)
        assert server.health_checks == 1
    finally:
        timer.join()
        server.stop()


def test_wait_until_up_keeps_waiting_while_health_says_unhealthy_and_gives_up_at_the_cap():
    with OpenAIServer() as server:
        server.health_status = 503
        policy = RetryPolicy(base_delay_s=0.05, max_delay_s=0.1, wait_max_s=0.6)
        outage = Outage(server.url, "is down", "refused", policy)
        with pytest.raises(InferenceUnavailable, match="gave up waiting after 0.6s"):
            wait_until_up(health_url(server.url), outage, outage.clock() + policy.wait_max_s)
        assert server.health_checks >= 2


def test_a_wait_for_a_down_server_yields_once_the_worker_is_told_to_stop(stop_in):
    url = f"http://127.0.0.1:{free_port()}"
    policy = RetryPolicy(base_delay_s=30.0, max_delay_s=30.0, jitter=False, wait_max_s=600.0)
    outage = Outage(url, "is down", "connection refused", policy)
    stop_in(0.2)  # during the first pause of 30 s
    with pytest.raises(shutdown.JobYielded, match=f"waiting for inference server at {url}, which is down"):
        wait_until_up(health_url(url), outage, outage.clock() + policy.wait_max_s)


def test_requests_waiting_together_for_a_down_server_all_yield_once_the_worker_is_told_to_stop(stop_in):
    watch = AsyncServerWatch(EndpointPool([f"http://127.0.0.1:{free_port()}"]), RetryPolicy(wait_max_s=600.0))

    async def two_requests_waiting() -> list:
        deadline = time.monotonic() + 600
        try:
            return await asyncio.gather(watch.wait("refused", deadline), watch.wait("refused", deadline),
                                        return_exceptions=True)
        finally:
            await watch.aclose()

    stop_in(0.2)
    results = asyncio.run(two_requests_waiting())
    assert [type(r) for r in results] == [shutdown.JobYielded, shutdown.JobYielded], results


def test_every_request_of_a_process_shares_one_tls_context(monkeypatch):
    """httpx builds a TLS context (the CA bundle loaded) for each new client, even for plain http; the
    extractor's per-sample POSTs, the health checks and the generator's client take the shared one."""
    import asyncio

    from services.generator.client import ChatClient
    from runtime import retry

    built: list[object] = []
    real = ssl.SSLContext.load_verify_locations

    def counting(self, *args, **kwargs):  # the costly part of a new context: reading the CA bundle
        built.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counting)
    retry.tls_context.cache_clear()
    with OpenAIServer() as server:
        for _ in range(3):
            answer = retry.post_json(server.url + "/v1/chat/completions", {"model": "stand-in-target"}, timeout=5)
            assert isinstance(answer, (httpx.Response, retry.Failed))  # answered either way: a request was made
            outage = Outage(server.url, "is down", "refused", RetryPolicy(base_delay_s=0.01, max_delay_s=0.01))
            retry.wait_until_up(server.url + "/health", outage, time.monotonic() + 5, sleep=lambda s: None)

        async def clients() -> None:
            for _ in range(3):
                async with ChatClient(server.url, timeout_s=5, max_connections=2):
                    pass

        asyncio.run(clients())
    assert len(built) == 1
    retry.tls_context.cache_clear()


PRELOAD_CHECK = """
import asyncio, sys
import httpx
from runtime.retry import preload_http
from tests.support.processes import free_port
preload_http()
before = set(sys.modules)
searched = []  # every module an import looks for from here on, found or not (a failed import is retried each time)
class Recorder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        searched.append(name)
        return None
sys.meta_path.insert(0, Recorder)
url = f"http://127.0.0.1:{free_port()}/"  # nothing listens: the request fails after loading its transport
async def first_request():
    async with httpx.AsyncClient() as client:
        try:
            await client.get(url)
        except httpx.ConnectError:
            pass
asyncio.run(first_request())
try:
    httpx.get(url)
except httpx.ConnectError:
    pass
ours = ("httpcore", "anyio", "certifi", "sniffio")
print(sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ours))
print(sorted({m for m in searched if m.split(".")[0] in ours}))
"""


def test_preload_http_leaves_nothing_of_httpx_to_import_at_a_clients_first_request():
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", PRELOAD_CHECK], capture_output=True, text=True, timeout=120,
                          cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stderr[-2000:]
    loaded, searched = done.stdout.strip().splitlines()
    assert loaded == "[]"  # a forked job process inherits them all
    assert searched == "[]"  # and looks for none per request (httpcore asks for sniffio on every one)
