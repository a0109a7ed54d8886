"""``draftline worker-health ROLE``, the worker containers' health check: healthy while Redis lists a worker of
that role on this host, against a real Redis and RQ's own worker registration."""

from __future__ import annotations

import socket

import pytest
from rq import Worker

from services.cli.main import main
from runtime.queues import queue
from runtime.worker import WORKER_TTL_S, registered_workers, worker_name


def register(conn, role: str, host: str, pid: int) -> Worker:
    """A worker registered as ``run_worker`` registers one (its name, RQ's birth record and TTL)."""
    worker = Worker([queue(f"draftline-{role}", conn)], connection=conn, name=worker_name(role, host, pid),
                    worker_ttl=WORKER_TTL_S)
    worker.register_birth()
    return worker


@pytest.fixture()
def health(redis_url, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)  # no .env
    monkeypatch.setenv("REDIS_URL", redis_url)

    def run(role: str) -> tuple[int, str, str]:
        code = main(["worker-health", role])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_only_this_hosts_workers_of_the_role_count(redis_conn):
    register(redis_conn, "generator", "aaa", 7)
    register(redis_conn, "generator", "bbb", 7)
    register(redis_conn, "extractor", "aaa", 8)
    assert registered_workers(redis_conn, "generator", "aaa") == ["generator-aaa-7"]
    assert registered_workers(redis_conn, "trainer", "aaa") == []
    # A host whose name begins like another's is another host.
    assert registered_workers(redis_conn, "generator", "aa") == []


def test_a_worker_whose_record_expired_is_not_healthy(redis_conn):
    worker = register(redis_conn, "generator", "aaa", 7)
    redis_conn.delete(worker.key)  # what its TTL does WORKER_TTL_S + 60 s after its last heartbeat
    assert registered_workers(redis_conn, "generator", "aaa") == []


def test_the_command_answers_for_this_host(health, redis_conn):
    code, out, err = health("extractor")
    assert code == 1 and out == ""
    assert f"extractor on {socket.gethostname()}: no worker registered in Redis" in err
    register(redis_conn, "extractor", socket.gethostname(), 12)
    code, out, _ = health("extractor")
    assert code == 0 and f"extractor-{socket.gethostname()}-12 registered" in out


def test_redis_unreachable_is_unhealthy_with_the_reason(health, monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    code, _, err = health("trainer")
    assert code == 1 and "Redis does not answer" in err
