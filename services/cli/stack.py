"""Every draftline service as a local process, started with exactly the commands docker-compose.yml runs.

``make demo`` and the end-to-end tests use this: Redis is reused when reachable and otherwise started
from Debian's ``redis-server``; each replica gets its own log file (``<service>-<index>.log``);
``stop()`` ends them in reverse order.

``StackConfig.replicas`` starts several processes of a service. Each replica of an HTTP service listens on
its own port; the workers and the controller get every inference replica, comma-separated, in
``DRAFTLINE_INFERENCE_URL`` and ``DRAFTLINE_HIDDEN_STATES_URL`` (they spread requests over the list), since
one server process is the bottleneck when a small target runs on a big GPU.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from shared.errors import DraftlineError
from shared.services import SERVICE_COMMANDS
from runtime.ports import free_port, free_ports

log = logging.getLogger(__name__)

HTTP_SERVICES = {"inference": "/health", "controller": "/health", "exporter": "/health"}
START_ORDER = ("inference", "controller", "exporter", "generator", "extractor", "trainer")


class StackError(DraftlineError):
    """A local service failed to start or died."""


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
    # Processes per service; a service not named runs one. ``{"inference": 4}`` starts four model servers.
    replicas: dict[str, int] = field(default_factory=lambda: {"generator": 1, "extractor": 1})
    env: dict[str, str] = field(default_factory=dict)
    # Extra environment of single replicas, on top of ``env``: ``replica_env["inference"][1]`` is replica 1's
    # (e.g. its own CUDA_VISIBLE_DEVICES); a replica past the end of its list gets none.
    replica_env: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    # The controller's DRAFTLINE_API_TOKEN; only the controller gets it, as in docker-compose.yml.
    api_token: str | None = None
    # The address the HTTP services listen on and are reached at: loopback unless workers of another host
    # must reach them, which then need an address of this machine on a network they share.
    host: str = "127.0.0.1"


@dataclass
class _Proc:
    name: str
    index: int
    popen: subprocess.Popen
    log_path: Path


class LocalStack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        # One port per replica, chosen now so URLs are known before start(); a replica keeps its port when
        # respawned, so the URL lists the other services hold stay valid. A service started with no replica
        # still gets a port: its URL then names nothing, as the single-port stack's did.
        self.ports: dict[str, list[int]] = {}
        for name in HTTP_SERVICES:
            self.ports[name] = free_ports(max(1, self.replica_count(name)))
        self.procs: list[_Proc] = []
        self.redis_url = config.redis_url or os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
        self._redis_proc: subprocess.Popen | None = None

    def replica_count(self, name: str) -> int:
        return self.config.replicas.get(name, 1)

    def url(self, service: str, index: int = 0) -> str:
        """The base URL of one replica of an HTTP service (the first by default)."""
        return f"http://{self.config.host}:{self.ports[service][index]}"

    def urls(self, service: str) -> list[str]:
        """The base URLs of every replica of an HTTP service, in replica order."""
        return [self.url(service, index) for index in range(len(self.ports[service]))]

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> LocalStack:
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        self._ensure_redis()
        for name in START_ORDER:
            count = self.replica_count(name)
            for index in range(count):
                self._spawn(name, index)
            if name in HTTP_SERVICES:
                for index in range(count):  # the replicas load in parallel; each is waited for in turn
                    self._wait_healthy(name, index)
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
        """The processes of ``name``, in replica order (``processes(name)[i]`` is replica ``i``)."""
        return [proc.popen for proc in self.procs if proc.name == name]

    def log_paths(self, name: str) -> list[Path]:
        """Each replica's log file, in replica order."""
        return [proc.log_path for proc in self.procs if proc.name == name]

    def kill(self, name: str, index: int = 0, sig: int = signal.SIGKILL) -> None:
        """Signal one replica's whole process group (a worker and its forked job process)."""
        _signal(self.processes(name)[index], sig)

    def respawn(self, name: str, index: int = 0) -> None:
        """Start a replica again after it exited (what a container restart policy does), on its own port."""
        popen = self.processes(name)[index]
        if popen.poll() is None:
            popen.wait(30)
        position = next(i for i, p in enumerate(self.procs) if p.popen is popen)
        self._spawn(name, index)
        self.procs[position] = self.procs.pop()  # keep replica order, so indexes stay stable
        if name in HTTP_SERVICES:
            self._wait_healthy(name, index)

    def check_alive(self, name: str | None = None, index: int | None = None) -> None:
        """Raise naming any service (or any replica of ``name``, or only replica ``index``) that has exited."""
        for proc in self.procs:
            if (name is not None and proc.name != name) or (index is not None and proc.index != index):
                continue
            if proc.popen.poll() is not None:
                raise StackError(f"{proc.name} (replica {proc.index}) exited with {proc.popen.returncode}; "
                                 f"log: {proc.log_path}\n{_tail(proc.log_path)}")

    # ---- internals ------------------------------------------------------------------------------
    def service_env(self, name: str, index: int = 0) -> dict[str, str]:
        """The environment replica ``index`` of ``name`` starts with."""
        cfg = self.config
        inference = ",".join(self.urls("inference"))
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "DRAFTLINE_DATA": str(cfg.data),
            "REDIS_URL": self.redis_url,
            "DRAFTLINE_MODEL_DIR": str(cfg.model_dir),
            "DRAFTLINE_INFERENCE_URL": inference,
            "DRAFTLINE_HIDDEN_STATES_URL": inference,
            # A local stack is a demo or a test, often on /tmp: preflight warns instead of refusing.
            "DRAFTLINE_ALLOW_EPHEMERAL_DATA": "true",
            **cfg.env,
        }
        replica_envs = cfg.replica_env.get(name, [])
        if index < len(replica_envs):
            env.update(replica_envs[index])
        if name in self.ports:
            env["DRAFTLINE_PORT"] = str(self.ports[name][index])
            env["DRAFTLINE_HOST"] = cfg.host
        if name == "controller" and cfg.api_token is not None:
            env["DRAFTLINE_API_TOKEN"] = cfg.api_token
        return env

    def _spawn(self, name: str, index: int) -> None:
        log_path = self.config.log_dir / f"{name}-{index}.log"
        handle = open(log_path, "ab")
        popen = subprocess.Popen(
            resolve_command(SERVICE_COMMANDS[name]),
            env=self.service_env(name, index),
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches the demo only; it stops the services in order.
        )
        handle.close()
        self.procs.append(_Proc(name, index, popen, log_path))
        log.info("started %s replica %d (pid %d), log %s", name, index, popen.pid, log_path)

    def _wait_healthy(self, name: str, index: int, timeout: float = 180.0) -> None:
        url = self.url(name, index) + HTTP_SERVICES[name]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive(name, index)
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    log.info("%s replica %d healthy at %s", name, index, self.url(name, index))
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise StackError(f"{name} replica {index} not healthy at {url} after {timeout:.0f}s")

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
