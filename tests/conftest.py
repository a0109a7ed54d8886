"""Fixtures shared by every test: a private Redis server, a flushed connection, the tiny target."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support import smollm2_target
from tests.support.processes import RedisServer
from tests.support.system_packages import is_installed, missing_message
from tests.support.tiny_target import (
    cached_tiny_model,
    entry_for,
    is_intact,
    verify_unchanged,
)

# What each fixture's set-up costs (printed after the run), the order modules start in (longest first), and the
# tiny target's own samples, runs written from them and drafters trained on them (the trainer's, the evaluation's
# and the engines' tests share these).
pytest_plugins = ("tests.support.fixture_costs", "tests.support.schedule", "tests.support.tiny_runs")


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


# Set by bench/run_gpu_tests.sh: on the machine lent for them a missing CUDA device is a broken setup.
REQUIRE_GPU_ENV = "DRAFTLINE_REQUIRE_GPU"


def cuda_missing() -> str:
    """Why no CUDA device can run a ``gpu`` test here, or "" where one can."""
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'})"
    return ""


def skips_for_gpu(item: pytest.Item) -> bool:
    return item.get_closest_marker("gpu") is not None and bool(cuda_missing()) and not os.environ.get(REQUIRE_GPU_ENV)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``needs_package`` fails before its fixtures start where the package is missing:
    `make test` installs it, so a skip would only hide a broken setup. A test marked ``gpu`` skips on a
    machine without a CUDA device (a GPU is hardware, not a package), and fails there when
    ``DRAFTLINE_REQUIRE_GPU`` is set."""
    if item.get_closest_marker("gpu") is not None and (why := cuda_missing()):
        if os.environ.get(REQUIRE_GPU_ENV):
            pytest.fail(f"{REQUIRE_GPU_ENV} is set, but {why}", pytrace=False)
        pytest.skip(why)
    for mark in item.iter_markers("needs_package"):
        for package in mark.args:
            if not is_installed(package):
                pytest.fail(missing_message(package), pytrace=False)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker's torch gets its share of the cores, and so do the processes its tests
    start (they inherit the variables): two workers each running torch on every core would spin their OpenMP
    threads against each other, which made CPU-bound tests ten times slower, not two."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    threads = str(max(1, (os.cpu_count() or 1) // int(workers)))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, threads)
    if "torch" in sys.modules:  # imported already: it read the variables before they were set
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the tiny target (on a cache miss) before the first test starts, outside every test's timeout:
    inside the first test that needs it, a slow build would time out and error every test after it."""
    if session.config.option.collectonly or is_intact(entry_for()):
        return
    if any("tiny_model_dir" in getattr(item, "fixturenames", ()) and not skips_for_gpu(item) for item in session.items):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"building the tiny target into {entry_for()} (once per version of its code)")
        try:
            cached_tiny_model()
        except Exception:  # the fixture builds again and reports the error in the tests that need it
            logging.getLogger(__name__).exception("building the tiny target failed")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Iterator[Path]:
    """The built-in tiny target, built through the same code as ``make-tiny-model`` and cached across
    test runs (tests/support/tiny_target.py). Shared and read-only: a test that changes a model
    directory changes a copy; the session fails at its end if one wrote into this one."""
    model_dir = cached_tiny_model()
    yield model_dir
    verify_unchanged(model_dir)


@pytest.fixture(scope="session")
def smollm2_dir() -> Iterator[Path]:
    """SmolLM2-135M-Instruct converted from its shipped GGUF through ``ensure_target``, once per machine
    (tests/support/smollm2_target.py). Shared and read-only: the session fails at its end if a test wrote
    into it."""
    model_dir = smollm2_target.cached_smollm2()
    yield model_dir
    smollm2_target.verify_unchanged(model_dir)


@pytest.fixture()
def data_dir(tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    return path


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A CLI or service entrypoint run in-process reconfigures root logging onto pytest's captured stream,
    which closes with the test; later tests' log lines would then fail to emit ("I/O operation on closed
    file"). Each test gets back the root handlers and level it started with."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)
