"""The stack in real containers, set up the way the README tells a user to, on the test's own network.

`make test` runs tools/docker-setup.sh first: the engine, Compose and the images (a local Debian base,
draftline:cpu, Redis and Prometheus from Debian's packages). Without them the tests fail and name the
command, as a test needing a Debian package does."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator

import pytest

from tests.containers.stack import (
    DRAFTLINE_IMAGE,
    FILES,
    IMAGES,
    PACE,
    PROJECT_PREFIX,
    UID,
    Stack,
    drop_forwarding,
    remove_leftover_stacks,
)
from tests.support.compose import docker_missing, fill_env, image_missing
from tests.support.processes import REPO, free_port


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
