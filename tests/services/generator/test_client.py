"""The chat client against a real scripted OpenAI-compatible server: what each kind of trouble costs."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from services.generator.client import ChatClient, Completion
from shared.errors import InferenceRejected, InferenceUnavailable, PromptTooLong
from runtime.retry import RetryPolicy
from tests.support.openai_server import OpenAIServer, Reply
from tests.support.processes import free_port

FAST = RetryPolicy(max_attempts=3, base_delay_s=0.02, max_delay_s=0.1, wait_max_s=30)
NO_RETRIES = RetryPolicy(max_attempts=1, base_delay_s=0.02, max_delay_s=0.1, wait_max_s=30)


def payload(prompt: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}


async def ask(url: str, policy: RetryPolicy, *prompts: str) -> list[Completion | BaseException]:
    async with ChatClient(url, timeout_s=10, max_connections=4, policy=policy) as client:
        return await asyncio.gather(*(client.complete(payload(p)) for p in prompts), return_exceptions=True)


@pytest.fixture()
def server():
    with OpenAIServer() as srv:
        yield srv


def test_transient_answers_are_retried_and_permanent_ones_never(server):
    server.script("blip", Reply(status=500), Reply(status=429), Reply("fine after two retries"))
    server.script("busy", Reply(status=503, error="overloaded"))
    server.script("slow", Reply(status=408), Reply("fine after a 408"))
    server.script("long", Reply(status=400, error="This model's maximum context length is 8 tokens"))
    server.script("bad", Reply(status=422, error="messages: unsupported role"))
    blip, busy, slow, long, bad = asyncio.run(ask(server.url, FAST, "blip", "busy", "slow", "long", "bad"))
    assert (blip.content, slow.content) == ("fine after two retries", "fine after a 408")
    assert isinstance(busy, InferenceUnavailable)
    assert "HTTP 503: overloaded" in str(busy) and "gave up after 3 attempts" in str(busy)
    assert isinstance(long, PromptTooLong) and "maximum context length is 8 tokens" in str(long)  # vLLM wording, named
    assert isinstance(bad, InferenceRejected) and "unsupported role" in str(bad)
    counts = {p: len(server.requests_for(p)) for p in ("blip", "busy", "slow", "long", "bad")}
    assert counts == {"blip": 3, "busy": 3, "slow": 2, "long": 1, "bad": 1}


def test_a_server_that_comes_up_late_is_waited_for_without_spending_attempts(caplog):
    server = OpenAIServer()  # its port is fixed now; nothing listens on it yet
    caplog.set_level(logging.INFO, logger="runtime.retry")
    timer = threading.Timer(1.0, server.start)
    timer.start()
    try:
        # No retries at all, and still every request succeeds: waiting for a down server is free.
        answers = asyncio.run(ask(server.url + "/v1", NO_RETRIES, *(f"early{i}" for i in range(5))))
    finally:
        timer.join()
        server.stop()
    assert all(isinstance(a, Completion) for a in answers), answers
    assert server.health_checks == 1  # one poller for all five waiting requests
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"inference server at {server.url} is down (") and "ConnectError" in m
               and m.endswith("waiting for it") for m in messages)
    assert any(f"inference server at {server.url} is back after" in m for m in messages)


def test_waiting_for_a_down_server_ends_at_the_cap_as_inference_unavailable():
    url = f"http://127.0.0.1:{free_port()}"
    policy = RetryPolicy(max_attempts=3, base_delay_s=0.05, max_delay_s=0.1, wait_max_s=0.5)
    [error] = asyncio.run(ask(url, policy, "nobody home"))
    assert isinstance(error, InferenceUnavailable)
    assert f"inference server at {url} is down for 0s" in str(error)
    assert "ConnectError" in str(error) and "gave up waiting after 0.5s (DRAFTLINE_INFERENCE_WAIT_MAX_S)" in str(error)


def test_with_waiting_off_a_down_server_spends_retries_like_any_transient_trouble():
    url = f"http://127.0.0.1:{free_port()}"
    [error] = asyncio.run(ask(url, RetryPolicy.fixed((0.02, 0.02)), "nobody home"))
    assert isinstance(error, InferenceUnavailable)
    assert "ConnectError" in str(error) and "gave up after 3 attempts" in str(error)


def test_a_full_disk_507_is_waited_out_without_spending_attempts(server, caplog):
    caplog.set_level(logging.INFO, logger="runtime.retry")
    server.script("full", Reply(status=507, error="no space left on the volume"), Reply(status=507), Reply("stored"))
    [answer] = asyncio.run(ask(server.url, NO_RETRIES, "full"))
    assert answer.content == "stored"
    assert len(server.requests_for("full")) == 3
    messages = [r.getMessage() for r in caplog.records]
    assert any("has no disk space" in m and "no space left on the volume" in m for m in messages)
    assert any("is back after" in m for m in messages)


def test_a_disk_that_stays_full_fails_the_request_at_the_wait_cap(server):
    server.script("full", Reply(status=507, error="no space left"))
    policy = RetryPolicy(max_attempts=2, base_delay_s=0.05, max_delay_s=0.1, wait_max_s=0.4)
    [error] = asyncio.run(ask(server.url, policy, "full"))
    assert isinstance(error, InferenceUnavailable)
    assert "has no disk space" in str(error) and "gave up waiting after 0.4s" in str(error)
    assert len(server.requests_for("full")) > 2  # resent while waiting, beyond the two attempts


def test_a_reply_slower_than_the_timeout_is_retried(server):
    server.script("slow", Reply("too late", delay_s=3), Reply("in time"))

    async def run() -> Completion:
        async with ChatClient(server.url, timeout_s=0.5, max_connections=1, policy=FAST) as client:
            return await client.complete(payload("slow"))

    assert asyncio.run(run()).content == "in time"
    assert len(server.requests_for("slow")) == 2


def test_concurrent_requests_spread_over_live_endpoints_and_fail_over_from_a_dead_one():
    dead = f"http://127.0.0.1:{free_port()}"
    retries = []

    async def run(a: OpenAIServer, b: OpenAIServer) -> list[Completion]:
        async with ChatClient(f"{dead},{a.url},{b.url}", timeout_s=10, max_connections=4, policy=NO_RETRIES,
                              start=0) as client:
            return await asyncio.gather(*(client.complete(payload(f"q{i}"), on_retry=lambda: retries.append(1))
                                          for i in range(8)))

    with OpenAIServer() as a, OpenAIServer() as b:
        answers = asyncio.run(run(a, b))
        assert all(isinstance(x, Completion) for x in answers)  # no attempt to spare, yet none failed
        assert len(a.requests) >= 2 and len(b.requests) >= 2 and len(a.requests) + len(b.requests) == 8
    assert 1 <= len(retries) <= 3  # the requests sent to the dead endpoint before it cooled, each failed over


def test_when_every_endpoint_is_down_concurrent_requests_share_one_poller_until_one_is_back(caplog):
    dead, late = f"http://127.0.0.1:{free_port()}", OpenAIServer()
    caplog.set_level(logging.INFO, logger="runtime.retry")
    timer = threading.Timer(1.0, late.start)
    timer.start()
    try:
        answers = asyncio.run(ask(f"{dead},{late.url}", NO_RETRIES, *(f"early{i}" for i in range(4))))
    finally:
        timer.join()
        late.stop()
    assert all(isinstance(a, Completion) for a in answers), answers
    assert late.health_checks == 1
    assert any(r.getMessage().startswith(f"every inference server ({dead}, {late.url}) is down (")
               for r in caplog.records)
