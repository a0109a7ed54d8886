"""Failover, cooldown and waiting over several endpoints, against real HTTP servers and a real dead port."""

from __future__ import annotations

import logging
import threading

import httpx
import pytest

from runtime import shutdown
from runtime.dispatch import Dispatcher
from runtime.endpoint_pool import EndpointPool
from shared.errors import InferenceRejected, InferenceUnavailable, PromptTooLong
from runtime.retry import Failed, RetryPolicy, answer_trouble, transport_trouble
from tests.support.openai_server import OpenAIServer, Reply
from tests.support.processes import free_port
from tests.support.stopping import stop_in  # noqa: F401 - a fixture

# One attempt in all: whatever succeeds here succeeded by failing over or waiting, never by a retry.
ONE_ATTEMPT = RetryPolicy(max_attempts=1, base_delay_s=0.02, max_delay_s=0.1, wait_max_s=30)


def ask(root: str, prompt: str) -> tuple[str, str] | Failed:
    """One attempt: a chat request to ``root``; the endpoint and its reply's text, or the trouble."""
    url = f"{root}/v1/chat/completions"
    try:
        response = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": prompt}]},
                              timeout=10)
    except httpx.TransportError as exc:
        return transport_trouble(exc, url)
    failed = answer_trouble(response, url)
    return failed if failed is not None else (root, response.json()["choices"][0]["message"]["content"])


def dispatcher(urls: list[str], policy: RetryPolicy = ONE_ATTEMPT, *, cooldown_s: float = 60.0) -> Dispatcher:
    pool = EndpointPool(urls, start=0, cooldown_s=cooldown_s)
    return Dispatcher(pool, policy, "test request")


@pytest.fixture()
def servers():
    with OpenAIServer() as a, OpenAIServer() as b:
        yield a, b


def test_requests_are_spread_over_every_endpoint(servers):
    a, b = servers
    d = dispatcher([a.url, b.url])
    answers = [d.send(lambda root, i=i: ask(root, f"q{i}"))[0] for i in range(6)]
    assert answers == [a.url, b.url] * 3  # round-robin from the start the caller gave
    assert len(a.requests) == 3 and len(b.requests) == 3


def test_a_dead_endpoint_fails_over_at_once_counts_a_retry_and_is_skipped_while_it_cools(servers, caplog):
    live, _ = servers
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    caplog.set_level(logging.INFO, logger="runtime.endpoint_pool")
    d = dispatcher([dead, live.url])
    retries = []
    first, _ = d.send(lambda root: ask(root, "one"), on_retry=lambda: retries.append(1))
    assert first == live.url and retries == [1]  # the dead endpoint's refusal cost no attempt
    for i in range(4):  # the dead endpoint cools: nothing more is sent its way, nothing retried
        assert d.send(lambda root, i=i: ask(root, f"more{i}"), on_retry=lambda: retries.append(1))[0] == live.url
    assert retries == [1] and len(live.requests) == 5
    downs = [r.getMessage() for r in caplog.records if "is down" in r.getMessage()]
    assert len(downs) == 1 and downs[0].startswith(f"inference endpoint {dead} is down (") and "ConnectError" in downs[0]


def test_a_cooled_endpoint_is_probed_again_and_used_once_it_is_back(caplog):
    late, live = OpenAIServer(), OpenAIServer().start()  # late: its port is fixed, nothing listens yet
    caplog.set_level(logging.INFO, logger="runtime.endpoint_pool")
    try:
        d = dispatcher([late.url, live.url], cooldown_s=0.2)
        assert d.send(lambda root: ask(root, "before"))[0] == live.url
        late.start()
        answers = []
        while late.url not in answers:  # the cooldown ends, and a request probes it again
            answers.append(d.send(lambda root: ask(root, "after"))[0])
            assert len(answers) < 10_000, "the revived endpoint was never asked again"
        assert d.send(lambda root: ask(root, "spread"))[0] == live.url  # both in the rotation again
        assert any(f"inference endpoint {late.url} is up again" == r.getMessage() for r in caplog.records)
    finally:
        late.stop()
        live.stop()


def test_transient_trouble_fails_over_without_backoff_and_a_rejection_goes_nowhere_else(servers):
    a, b = servers
    a.script("busy", Reply(status=503, error="overloaded"))
    b.script("busy", Reply("served by b"))
    d = dispatcher([a.url, b.url])
    assert d.send(lambda root: ask(root, "busy")) == (b.url, "served by b")
    a.script("long", Reply(status=400, error="This model's maximum context length is 8 tokens"))
    b.script("bad", Reply(status=422, error="messages: unsupported role"))
    d = dispatcher([a.url, b.url])
    with pytest.raises(PromptTooLong, match="maximum context length"):
        d.send(lambda root: ask(root, "long"))
    with pytest.raises(InferenceRejected, match="unsupported role"):
        d.send(lambda root: ask(root, "bad"))
    assert len(b.requests_for("long")) == 0 and len(a.requests_for("bad")) == 0


def test_when_every_endpoint_is_down_the_request_waits_for_the_first_to_come_back(caplog):
    dead, late = f"http://127.0.0.1:{free_port()}", OpenAIServer()
    caplog.set_level(logging.INFO, logger="runtime.retry")
    timer = threading.Timer(1.0, late.start)
    timer.start()
    try:
        answer = dispatcher([dead, late.url]).send(lambda root: ask(root, "patient"))
    finally:
        timer.join()
        late.stop()
    assert answer[0] == late.url and late.health_checks == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"every inference server ({dead}, {late.url}) is down (") for m in messages)
    assert any(m.startswith(f"inference server at {late.url} is back after") for m in messages)


def test_when_every_endpoint_fails_each_round_spends_one_attempt_and_the_error_names_the_last():
    with OpenAIServer() as a, OpenAIServer() as b:
        a.set_default(Reply(status=500, error="CUDA error"))
        b.set_default(Reply(status=503, error="overloaded"))
        retries = []
        with pytest.raises(InferenceUnavailable, match=r"HTTP 50[03].*gave up after 2 attempts"):
            dispatcher([a.url, b.url], RetryPolicy.fixed((0.02,)), cooldown_s=0.01).send(
                lambda root: ask(root, "doomed"), on_retry=lambda: retries.append(1))
        assert len(a.requests) + len(b.requests) == 4 and len(a.requests) == 2  # two rounds over both
        assert len(retries) == 3


def test_a_request_backing_off_after_transient_trouble_yields_once_the_worker_is_told_to_stop(stop_in):
    with OpenAIServer() as server:
        server.set_default(Reply(status=503, error="overloaded"))
        retries = []
        stop_in(0.2)  # during the 30 s before the second attempt
        with pytest.raises(shutdown.JobYielded, match="waiting to send a test request again"):
            dispatcher([server.url], RetryPolicy.fixed((30.0,))).send(lambda root: ask(root, "busy"),
                                                                    on_retry=lambda: retries.append(1))
    assert len(server.requests) == 1 and retries == []  # the yield is neither an attempt nor a retry


def test_a_worker_told_to_stop_starts_no_request_while_every_endpoint_is_known_down(stop_in):
    d = dispatcher([f"http://127.0.0.1:{free_port()}"])
    d.pool.failed(d.pool.endpoints[0], "refused")  # an earlier request found it down; it cools for 60 s
    attempts = []
    stop_in(0)
    with pytest.raises(shutdown.JobYielded, match="every endpoint for a test request was down"):
        d.send(lambda root: attempts.append(root))
    assert attempts == []
