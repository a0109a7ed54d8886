"""Fixtures shared by every test: a private Redis server, a flushed connection, the tiny target."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from tests.support.processes import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """One redis-server for the whole session on a free port, so tests never touch the machine's own."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture()
def redis_url(redis_server: RedisServer) -> str:
    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()
    yield redis_server.url
    conn.flushall()


@pytest.fixture()
def redis_conn(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny target, built once per session through the same code as ``make-tiny-model``."""
    from services.inference.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture()
def data_dir(tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    return path
