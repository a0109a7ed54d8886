"""``draftline serve exporter`` as a real process: scraped over HTTP, with Redis up and then gone."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import redis

from shared import metrics
from runtime.gpu import GpuReader
from runtime.runstate import RunState
from shared.lifecycle import Failure, FailureKind
from tests.services.exporter.scrape import parse, value
from tests.support.processes import RedisServer, ServiceProcess, free_port


def exporter(redis_url: str, data: Path, log_dir: Path) -> tuple[ServiceProcess, str]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data), "DRAFTLINE_PORT": str(port), "DRAFTLINE_HOST": "127.0.0.1"}
    return ServiceProcess("exporter", env=env, log_dir=log_dir, health_url=f"{base}/health"), base


def visible_gpus() -> int:
    """GPUs NVML shows this machine (0 on a CPU-only one); the exporter must report the same number."""
    reader = GpuReader()
    try:
        return len(reader.read())
    finally:
        reader.close()


def scrape(base: str) -> dict:
    response = httpx.get(f"{base}/metrics", timeout=15)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


def test_scrape_reports_a_run_populated_through_runstate(redis_url, redis_conn, data_dir, tmp_path) -> None:
    state = RunState(redis_conn, data_dir, "demo")
    state.register(20)
    for sample_id in range(6):
        state.mark_done("generate", sample_id)
    state.mark_done("extract", 0)
    state.mark_failed(Failure("demo", "generate", 6, "InferenceUnavailable", "connection refused"))
    state.mark_failed(Failure("demo", "generate", 7, "ReplyTooShort", "2 tokens", kind=FailureKind.DROPPED))
    state.incr("hidden_bytes", 123_456)
    proc, base = exporter(redis_url, data_dir, tmp_path / "logs")
    with proc:
        samples = scrape(base)
        assert value(samples, metrics.REDIS_UP) == 1
        assert value(samples, metrics.STAGE_EXPECTED, run="demo", stage="generate") == 20
        assert value(samples, metrics.STAGE_DONE, run="demo", stage="generate") == 6
        assert value(samples, metrics.STAGE_FAILED, run="demo", stage="generate") == 1
        assert value(samples, metrics.STAGE_DROPPED, run="demo", stage="generate") == 1
        assert value(samples, metrics.STAGE_REMAINING, run="demo", stage="generate") == 12
        assert value(samples, metrics.STAGE_DONE, run="demo", stage="extract") == 1
        assert value(samples, metrics.RUN_HIDDEN_BYTES, run="demo") == 123_456
        assert value(samples, metrics.VOLUME_FREE) > 0
        assert value(samples, metrics.GPUS) == visible_gpus()

        # Read at scrape time: work done after start-up shows in the next scrape.
        state.mark_done("generate", 8)
        assert value(scrape(base), metrics.STAGE_DONE, run="demo", stage="generate") == 7


def test_scrape_answers_with_redis_up_zero_while_redis_is_gone(data_dir, tmp_path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    try:
        proc, base = exporter(server.url, data_dir, tmp_path / "logs")
        with proc:
            assert value(scrape(base), metrics.REDIS_UP) == 1
            server.stop()
            for _ in range(2):
                samples = scrape(base)
                assert value(samples, metrics.REDIS_UP) == 0
                assert value(samples, metrics.VOLUME_USED) > 0
                assert value(samples, metrics.GPUS) == visible_gpus()
            assert proc.alive()
            # The same Redis back on its port: the next scrape reconnects without a restart.
            server = RedisServer(tmp_path / "redis", port=server.port).start()
            RunState(redis.Redis.from_url(server.url), data_dir, "after").register(3)
            samples = scrape(base)
            assert value(samples, metrics.REDIS_UP) == 1
            assert value(samples, metrics.STAGE_EXPECTED, run="after", stage="extract") == 3
            assert proc.log().count("redis unreachable") == 1  # one line per outage, not per scrape
    finally:
        server.stop()


def test_health_answers_and_other_paths_are_not_found(redis_url, data_dir, tmp_path) -> None:
    proc, base = exporter(redis_url, data_dir, tmp_path / "logs")
    with proc:
        assert httpx.get(f"{base}/health", timeout=5).text == "ok\n"
        assert httpx.get(f"{base}/nothing-here", timeout=5).status_code == 404


def test_sigterm_stops_the_exporter_cleanly(redis_url, data_dir, tmp_path) -> None:
    proc, _ = exporter(redis_url, data_dir, tmp_path / "logs")
    proc.start()
    proc.stop(signal.SIGTERM)
    assert proc.proc.returncode == 0, proc.log()
    assert "exporter: stopping" in proc.full_log()


def test_invalid_settings_stop_the_exporter_with_the_variable_named(redis_url, data_dir, tmp_path) -> None:
    proc = ServiceProcess(
        "exporter", env={"REDIS_URL": redis_url, "DRAFTLINE_PORT": "not-a-port"}, log_dir=tmp_path / "logs"
    ).start()
    try:
        proc.proc.wait(60)
    finally:
        proc.stop()
    assert proc.proc.returncode != 0
    assert "DRAFTLINE_PORT" in proc.full_log()

