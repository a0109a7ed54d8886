"""The pool's choice of endpoint: spread, cooldown, probing again."""

from __future__ import annotations

import logging

from runtime.endpoint_pool import EndpointPool


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_go_round_robin_from_the_start_and_to_the_least_busy_endpoint():
    pool = EndpointPool("http://a:1,http://b:1,http://c:1", start=4)  # 4 % 3: b first
    assert [pool.pick().url for _ in range(4)] == ["http://b:1", "http://c:1", "http://a:1", "http://b:1"]
    a, b, c = pool.endpoints
    with pool.lease(c), pool.lease(a), pool.lease(a):
        assert pool.pick() is b  # the only endpoint with nothing in flight
        with pool.lease(b):
            assert pool.pick() in (b, c)  # one each in flight; a has two
            assert pool.pick(exclude={b.url, c.url}) is a
    assert pool.pick(exclude=pool.urls) is None
    assert (a.in_flight, b.in_flight, c.in_flight) == (0, 0, 0)


def test_a_failed_endpoint_cools_down_longer_each_time_and_is_probed_once_its_cooldown_ends(caplog):
    clock = FakeClock()
    pool = EndpointPool(["http://a:1", "http://b:1"], start=0, cooldown_s=2, cooldown_max_s=5, clock=clock)
    a, b = pool.endpoints
    caplog.set_level(logging.INFO, logger="runtime.endpoint_pool")
    pool.failed(a, "ConnectError: refused")
    pool.failed(a, "ConnectError: refused")  # a concurrent request saw the same outage: no longer cooldown
    assert a.cool_until == clock.now + 2
    assert [pool.pick().url for _ in range(3)] == ["http://b:1"] * 3
    assert not pool.available(exclude={b.url})
    clock.now += 2
    assert pool.available(exclude={b.url}) and pool.pick(exclude={b.url}) is a  # probed again
    pool.failed(a, "ConnectError: refused")
    assert a.cool_until == clock.now + 4
    clock.now += 4
    pool.failed(a, "ConnectError: refused")
    assert a.cool_until == clock.now + 5  # capped
    pool.failed(b, "HTTP 503")
    assert pool.pick() is b  # every endpoint cools: the one whose cooldown ends first
    pool.succeeded(a)
    assert pool.pick() is a and a.failures == 0
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        ("inference endpoint http://a:1 is down (ConnectError: refused); using the other endpoints, probing it "
         "again in 2s"),
        "inference endpoint http://b:1 is down (HTTP 503); using the other endpoints, probing it again in 2s",
        "inference endpoint http://a:1 is up again",
    ]  # state changes only, not every failure


def test_one_endpoint_logs_nothing_of_its_own():
    pool = EndpointPool("http://a:1")
    pool.failed(pool.endpoints[0], "refused")
    assert pool.pick() is pool.endpoints[0]  # cooling, and still the only one to ask
