"""Every draftline service as a local process, started with exactly the commands docker-compose.yml runs.

``make demo`` and the end-to-end tests use this: Redis is reused when reachable and otherwise started
from Debian's ``redis-server``; each service gets its own log file; ``stop()`` ends them in reverse order.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from shared.errors import DraftlineError
from shared.services import SERVICE_COMMANDS

log = logging.getLogger(__name__)

HTTP_SERVICES = {"inference": "/health", "controller": "/health", "exporter": "/health"}
START_ORDER = ("inference", "controller", "exporter", "generator", "extractor", "trainer")


class StackError(DraftlineError):
    """A local service failed to start or died."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_command(argv: list[str]) -> list[str]:
    """``draftline …`` from the table, run with the console script of this interpreter's environment."""
    script = Path(sys.executable).parent / argv[0]
    found = str(script) if script.exists() else shutil.which(argv[0])
    if found is None:
        raise StackError(f"{argv[0]!r} is not installed in this environment (run `make install`)")
    return [found, *argv[1:]]


@dataclass
class StackConfig:
    data: Path
    model_dir: Path
    log_dir: Path
    redis_url: str | None = None
    replicas: dict[str, int] = field(default_factory=lambda: {"generator": 1, "extractor": 1})
    env: dict[str, str] = field(default_factory=dict)
    # The controller's DRAFTLINE_API_TOKEN; only the controller gets it, as in docker-compose.yml.
    api_token: str | None = None


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path


class LocalStack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.ports = {name: free_port() for name in HTTP_SERVICES}
        self.procs: list[_Proc] = []
        self.redis_url = config.redis_url or os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
        self._redis_proc: subprocess.Popen | None = None

    def url(self, service: str) -> str:
        return f"http://127.0.0.1:{self.ports[service]}"

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> LocalStack:
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        self._ensure_redis()
        for name in START_ORDER:
            for index in range(self.config.replicas.get(name, 1)):
                self._spawn(name, index)
            if name in HTTP_SERVICES:
                self._wait_healthy(name)
        return self

    def stop(self, timeout: float = 20.0) -> None:
        for proc in reversed(self.procs):
            _signal(proc.popen, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in reversed(self.procs):
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", proc.name)
                _signal(proc.popen, signal.SIGKILL)
                proc.popen.wait()
        self.procs.clear()
        if self._redis_proc is not None:
            self._redis_proc.terminate()
            self._redis_proc.wait(10)
            self._redis_proc = None

    def __enter__(self) -> LocalStack:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def processes(self, name: str) -> list[subprocess.Popen]:
        return [proc.popen for proc in self.procs if proc.name == name]

    def kill(self, name: str, index: int = 0, sig: int = signal.SIGKILL) -> None:
        """Signal one replica's whole process group (a worker and its forked job process)."""
        _signal(self.processes(name)[index], sig)

    def respawn(self, name: str, index: int = 0) -> None:
        """Start a replica again after it exited (what a container restart policy does)."""
        popen = self.processes(name)[index]
        if popen.poll() is None:
            popen.wait(30)
        position = next(i for i, p in enumerate(self.procs) if p.popen is popen)
        self._spawn(name, index)
        self.procs[position] = self.procs.pop()  # keep replica order, so indexes stay stable
        if name in HTTP_SERVICES:
            self._wait_healthy(name)

    def check_alive(self, name: str | None = None) -> None:
        """Raise naming any service (or any replica of ``name``) that has exited."""
        for proc in self.procs:
            if (name is None or proc.name == name) and proc.popen.poll() is not None:
                raise StackError(f"{proc.name} exited with {proc.popen.returncode}; log: {proc.log_path}\n{_tail(proc.log_path)}")

    # ---- internals ------------------------------------------------------------------------------
    def service_env(self, name: str) -> dict[str, str]:
        cfg = self.config
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "DRAFTLINE_DATA": str(cfg.data),
            "REDIS_URL": self.redis_url,
            "DRAFTLINE_MODEL_DIR": str(cfg.model_dir),
            "DRAFTLINE_INFERENCE_URL": self.url("inference"),
            "DRAFTLINE_HIDDEN_STATES_URL": self.url("inference"),
            # A local stack is a demo or a test, often on /tmp: preflight warns instead of refusing.
            "DRAFTLINE_ALLOW_EPHEMERAL_DATA": "true",
            **cfg.env,
        }
        if name in self.ports:
            env["DRAFTLINE_PORT"] = str(self.ports[name])
            env["DRAFTLINE_HOST"] = "127.0.0.1"
        if name == "controller" and cfg.api_token is not None:
            env["DRAFTLINE_API_TOKEN"] = cfg.api_token
        return env

    def _spawn(self, name: str, index: int) -> None:
        log_path = self.config.log_dir / f"{name}-{index}.log"
        handle = open(log_path, "ab")
        popen = subprocess.Popen(
            resolve_command(SERVICE_COMMANDS[name]),
            env=self.service_env(name),
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches the demo only; it stops the services in order.
        )
        handle.close()
        self.procs.append(_Proc(name, popen, log_path))
        log.info("started %s (pid %d), log %s", name, popen.pid, log_path)

    def _wait_healthy(self, name: str, timeout: float = 180.0) -> None:
        url = self.url(name) + HTTP_SERVICES[name]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive(name)
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    log.info("%s healthy at %s", name, self.url(name))
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise StackError(f"{name} not healthy at {url} after {timeout:.0f}s")

    def _ensure_redis(self) -> None:
        try:
            redis.Redis.from_url(self.redis_url, socket_connect_timeout=1).ping()
            log.info("using redis at %s", self.redis_url)
            return
        except redis.RedisError:
            pass
        binary = shutil.which("redis-server")
        if binary is None:
            raise StackError(f"no redis reachable at {self.redis_url} and redis-server is not installed (apt-get install redis-server)")
        port = free_port()
        workdir = self.config.data / "redis"
        workdir.mkdir(parents=True, exist_ok=True)
        self._redis_proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
            stdout=open(self.config.log_dir / "redis.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        conn = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + 20
        while True:
            try:
                conn.ping()
                log.info("started redis-server at %s", self.redis_url)
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise StackError("redis-server did not start") from None
                time.sleep(0.05)


def _signal(popen: subprocess.Popen, sig: int) -> None:
    if popen.poll() is None:
        try:
            os.killpg(popen.pid, sig)
        except ProcessLookupError:
            pass


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""
