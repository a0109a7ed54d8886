"""Drive a real Docker Compose project from a test: the repository's compose files, an env file the test
filled in, a project name of the test's own. Every call is the ``docker compose`` command a user types."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.processes import REPO

SETUP = "bash tools/docker-setup.sh"  # what installs the engine and builds the images (make test runs it)


class ComposeError(RuntimeError):
    """A ``docker compose`` command failed; the message holds its output."""


def compose_missing() -> str:
    """Why ``docker compose`` cannot run here, or ""."""
    if shutil.which("docker") is None:
        return f"no docker command: {SETUP} installs it (make test runs it)"
    compose = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True, text=True)
    if compose.returncode != 0:
        return f"no Docker Compose plugin: {SETUP} installs it"
    return ""


def docker_missing() -> str:
    """Why no Docker engine with Compose can run a container test here, or "" where one can."""
    if why := compose_missing():
        return why
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    if info.returncode != 0:
        return f"no Docker engine answers ({info.stderr.strip()[:200]}): {SETUP} starts one"
    return ""


def image_missing(*tags: str) -> str:
    """The first of ``tags`` that is not a local image, named with how to build it, or ""."""
    for tag in tags:
        if subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode != 0:
            return f"no image {tag}: {SETUP} builds it"
    return ""


def fill_env(example: Path, values: dict[str, str]) -> str:
    """``.env.example`` with each ``NAME=`` line given its value (the README's "fill it"), and the names
    the example does not hold as a ``NAME=`` line appended."""
    text = example.read_text()
    rest = dict(values)
    for name in list(rest):
        line = re.compile(rf"^(# )?{re.escape(name)}=.*$", re.MULTILINE)
        text, count = line.subn(f"{name}={rest[name]}", text, count=1)
        if count:
            del rest[name]
    return text + "".join(f"{name}={value}\n" for name, value in rest.items())


@dataclass
class ComposeProject:
    """One compose project: ``docker compose --env-file ENV -p NAME -f FILE …`` run from the repository."""

    name: str
    env_file: Path
    files: Sequence[str]
    log: list[str] = field(default_factory=list)

    def argv(self, *args: str) -> list[str]:
        files = [arg for name in self.files for arg in ("-f", str(REPO / name))]
        return ["docker", "compose", "--ansi", "never", "--env-file", str(self.env_file), "-p", self.name,
                *files, *args]

    def run(self, *args: str, timeout: float = 600.0, check: bool = True, stdin: str | None = None) -> str:
        """The command's standard output; ComposeError with both streams when it fails and ``check``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_BUILDKIT"))}
        started = time.monotonic()
        done = subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env,
                              input=stdin)
        self.log.append(f"[{time.monotonic() - started:6.1f}s rc={done.returncode}] docker compose {' '.join(args)}")
        if check and done.returncode != 0:
            raise ComposeError(f"docker compose {' '.join(args)} exited {done.returncode}:\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done.stdout

    def exec(self, service: str, *argv: str, index: int | None = None, timeout: float = 120.0,
             check: bool = True) -> str:
        """``docker compose exec -T [--index N] SERVICE ARGV…``: its standard output."""
        replica = ["--index", str(index)] if index is not None else []
        return self.run("exec", "-T", *replica, service, *argv, timeout=timeout, check=check)

    def containers(self, *, all_states: bool = False) -> list[dict]:
        """``docker compose ps`` as records: Name, Service, State, Health, ExitCode, …"""
        out = self.run("ps", "--format", "json", *(["--all"] if all_states else []))
        out = out.strip()
        if not out:
            return []
        # Compose 2.21+ prints one JSON object per line; older releases printed one array.
        return json.loads(out) if out.startswith("[") else [json.loads(line) for line in out.splitlines()]

    def container_names(self, service: str) -> list[str]:
        return sorted(c["Name"] for c in self.containers() if c["Service"] == service)

    def unhealthy(self) -> dict[str, str]:
        """Each container not yet running-and-healthy (running, for one without a health check): its state."""
        states = {}
        for c in self.containers(all_states=True):
            if c["State"] != "running" or c.get("Health", "") not in ("", "healthy"):
                states[c["Name"]] = f"{c['State']} {c.get('Health', '')}".strip()
        return states

    def logs(self, service: str) -> str:
        return self.run("logs", "--no-color", "--no-log-prefix", service, timeout=120)
