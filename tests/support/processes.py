"""Start real processes for tests: a private redis-server, draftline services, with logs kept on disk."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx
import redis

from runtime.ports import free_port  # noqa: F401 - the tests' one way to a free port

REPO = Path(__file__).resolve().parents[2]


class RedisServer:
    """A redis-server on a free loopback port, without persistence, owned by the test.

    With ``acl_env`` (REDIS_PASSWORD and any role passwords, runtime/redis_acl.py) it starts the way the
    compose stack's redis service does, through redis/start.sh: the default user's password and one ACL
    user per role password set."""

    def __init__(self, workdir: Path, port: int | None = None, *, acl_env: Mapping[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.workdir = Path(workdir)
        self.acl_env = dict(acl_env) if acl_env is not None else None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The default user's URL (with REDIS_PASSWORD when ``acl_env`` gave one)."""
        password = (self.acl_env or {}).get("REDIS_PASSWORD")
        return self.url_for("", password) if password else f"redis://127.0.0.1:{self.port}/0"

    def url_for(self, user: str, password: str) -> str:
        return f"redis://{user}:{password}@127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed; `make test` installs it as root, or run: sudo bash tools/system-packages.sh redis-server")
        self.workdir.mkdir(parents=True, exist_ok=True)
        options = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--dir", str(self.workdir)]
        env = None
        argv = [binary, *options]
        if self.acl_env is not None:
            argv = ["sh", str(REPO / "redis" / "start.sh"), *options]
            env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTLINE_REDIS_")} | self.acl_env
        self.proc = subprocess.Popen(
            argv, env=env, stdout=open(self.workdir / "redis.log", "ab"), stderr=subprocess.STDOUT,
        )
        conn = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 20
        while True:
            try:
                conn.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} did not start: "
                                       f"{(self.workdir / 'redis.log').read_text(errors='replace')[-2000:]}")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ServiceProcess:
    """``draftline serve NAME`` (exactly what a container runs) as a child process."""

    def __init__(self, name: str, env: dict[str, str], log_dir: Path, *, health_url: str | None = None) -> None:
        self.name = name
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        self.log_path = Path(log_dir) / f"{name}-{time.monotonic_ns()}.log"
        self.health_url = health_url
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> ServiceProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli.main", "serve", self.name],
            cwd=REPO, env=self.env, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if self.health_url:
            self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.health_url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not healthy after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        """The log's last 8,000 characters: for a failure message, not for finding a line (``full_log``)."""
        return self.full_log()[-8000:]

    def full_log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if not self.alive():
            return
        os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
