"""The stack in real containers, set up the way the README tells a user to, on the test's own network.

`make test` runs tools/docker-setup.sh first: the engine, Compose and the images (a local Debian base,
draftline:cpu, Redis and Prometheus from Debian's packages). Without them the tests fail and name the
command, as a test needing a Debian package does."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.compose import ComposeProject, docker_missing, fill_env, image_missing, wait_until
from tests.support.processes import REPO, free_port

FILES = ("docker-compose.yml", "docker-compose.cpu.yml", "tests/containers/compose.test.yml")
IMAGES = {"DRAFTLINE_REDIS_IMAGE": "draftline-redis:bookworm",
          "DRAFTLINE_PROMETHEUS_IMAGE": "draftline-prometheus:bookworm"}
DRAFTLINE_IMAGE = "draftline:cpu"  # docker-compose.cpu.yml's default tag
UID = 1000  # the containers' user (DRAFTLINE_UID), owner of the data directory
# The pace of the sample stages: one request at a time per generator and batches of two samples per job,
# so a run of a few hundred samples lasts long enough for faults to land while it works, and every
# replica of a scaled service gets jobs.
PACE = {"DRAFTLINE_CONCURRENCY": "1", "DRAFTLINE_BATCH_WAIT_MS": "200", "DRAFTLINE_GENERATE_BATCH": "2",
        "DRAFTLINE_EXTRACT_BATCH": "2"}
HEALTHY_TIMEOUT_S = 300.0
PROJECT_PREFIX = "draftline-test-"


class Stack(ComposeProject):
    """The test's compose project with what the tests need to reach it."""

    root: Path
    data: Path
    controller_url: str
    prometheus_url: str
    token: str

    def wait_healthy(self, timeout: float = HEALTHY_TIMEOUT_S) -> None:
        wait_until(lambda: self.containers() and not self.unhealthy(), "every service running and healthy",
                   timeout, interval=2.0, detail=self.unhealthy)

    def save_logs(self) -> Path:
        folder = self.root / "logs"
        folder.mkdir(exist_ok=True)
        for service in ("redis", "inference", "controller", "generator", "extractor", "trainer", "exporter",
                        "prometheus"):
            (folder / f"{service}.log").write_text(self.run("logs", "--no-color", service, check=False, timeout=120))
        (folder / "compose-commands.log").write_text("\n".join(self.log) + "\n")
        return folder


def remove_leftover_stacks() -> None:
    """Stacks an interrupted test left behind (`restart: unless-stopped` brings them back with dockerd):
    their containers and networks, found by Compose's project label."""
    projects = subprocess.run(["docker", "ps", "-a", "--format", '{{ .Label "com.docker.compose.project" }}'],
                              capture_output=True, text=True, check=True).stdout.split()
    for project in sorted({p for p in projects if p.startswith(PROJECT_PREFIX)}):
        ids = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"],
                             capture_output=True, text=True, check=True).stdout.split()
        subprocess.run(["docker", "rm", "-f", *ids], capture_output=True)
        networks = subprocess.run(["docker", "network", "ls", "-q", "--filter",
                                   f"label=com.docker.compose.project={project}"],
                                  capture_output=True, text=True, check=True).stdout.split()
        if networks:
            subprocess.run(["docker", "network", "rm", *networks], capture_output=True)


def drop_forwarding(bridge: str, *, add: bool) -> None:
    """Reject whatever the published network's containers send to anything but that network (DOCKER-USER
    is the chain Docker leaves to the host's own rules): their published ports work, nothing leaves."""
    rule = ["DOCKER-USER", "-i", bridge, "!", "-o", bridge, "-j", "REJECT"]
    present = subprocess.run(["iptables", "-C", *rule], capture_output=True).returncode == 0
    if add and not present:
        subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True)
    elif not add and present:
        subprocess.run(["iptables", "-D", *rule], check=True, capture_output=True)


@pytest.fixture(scope="session")
def docker_ready() -> None:
    """The engine answers and every image is built from the tree as it is now: the set-up's image step
    rebuilds whatever is older than its inputs (a code change since the last `make test`), and does
    nothing otherwise."""
    if why := docker_missing():
        pytest.fail(why, pytrace=False)
    built = subprocess.run(["bash", str(REPO / "tools" / "docker-setup.sh"), "images"], capture_output=True,
                           text=True, timeout=1800)
    if built.returncode != 0:
        pytest.fail(f"tools/docker-setup.sh images failed:\n{built.stderr[-3000:]}", pytrace=False)
    if why := image_missing(DRAFTLINE_IMAGE, *IMAGES.values()):
        pytest.fail(why, pytrace=False)


@pytest.fixture(scope="module")
def stack(docker_ready, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The README's steps: `cp .env.example .env` and fill it, make the target in a container, `docker
    compose up -d`; every service healthy. Stopped with `docker compose down -v` after the module."""
    root = tmp_path_factory.mktemp("containers")
    data = root / "data"
    data.mkdir()
    os.chown(data, UID, UID)
    suffix = f"{os.getpid()}"
    bridge = f"dltest{suffix}"[:15]
    ports = {"DRAFTLINE_CONTROLLER_HOST_PORT": free_port(), "PROMETHEUS_HOST_PORT": free_port(),
             "DRAFTLINE_REDIS_HOST_PORT": free_port()}
    token = secrets.token_urlsafe(24)
    env_file = root / ".env"
    env_file.write_text(fill_env(REPO / ".env.example", {
        "REDIS_PASSWORD": secrets.token_urlsafe(24),
        "DRAFTLINE_API_TOKEN": token,
        "DRAFTLINE_DATA_DIR": str(data),
        "DRAFTLINE_MODEL_DIR_HOST": str(data / "models" / "tiny"),
        "GRAFANA_ADMIN_PASSWORD": secrets.token_urlsafe(12),
        **{name: str(port) for name, port in ports.items()},
        **IMAGES, **PACE,
        "DRAFTLINE_TEST_BRIDGE": bridge,
    }))
    env_file.chmod(0o600)
    remove_leftover_stacks()
    project = Stack(name=f"{PROJECT_PREFIX}{suffix}", env_file=env_file, files=FILES)
    project.root, project.data, project.token = root, data, token
    project.controller_url = f"http://127.0.0.1:{ports['DRAFTLINE_CONTROLLER_HOST_PORT']}"
    project.prometheus_url = f"http://127.0.0.1:{ports['PROMETHEUS_HOST_PORT']}"
    drop_forwarding(bridge, add=True)
    try:
        project.run("run", "--rm", "--no-deps", "controller", "draftline", "make-target", "tiny", "/data/models/tiny")
        project.run("up", "-d")
        project.wait_healthy()
        yield project
    finally:
        logs = project.save_logs()
        project.run("down", "--volumes", "--remove-orphans", "--timeout", "30", check=False)
        drop_forwarding(bridge, add=False)
        print(f"\ncontainer logs: {logs}")
