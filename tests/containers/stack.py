"""The container tests' compose project: the files, images and pace it runs with, and what the tests need
to reach it and to clean up after it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.compose import ComposeProject
from tests.support.polling import wait_until

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
