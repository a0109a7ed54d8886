"""tools/docker-setup.sh against the real engine: Compose is new enough, every image it builds carries the hash
of its inputs, a second run builds nothing, and an image whose label does not match its inputs is rebuilt."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.support.compose import docker_missing
from tests.support.processes import REPO

pytestmark = [pytest.mark.containers, pytest.mark.slow]

SCRIPT = REPO / "tools" / "docker-setup.sh"
IMAGES = ("draftline-base:bookworm", "draftline-redis:bookworm", "draftline-prometheus:bookworm", "draftline:cpu")
LABEL = "org.draftline.inputs"


def setup(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=1800,
                          env={**os.environ, **env})


def inputs_label(tag: str) -> str:
    return subprocess.run(["docker", "image", "inspect", "-f", f'{{{{ index .Config.Labels "{LABEL}" }}}}', tag],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module", autouse=True)
def _engine() -> None:
    if why := docker_missing():
        pytest.fail(why, pytrace=False)


def test_compose_is_at_least_the_release_the_compose_files_need() -> None:
    version = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True, text=True,
                             check=True).stdout.strip().removeprefix("v")
    major, minor = (int(part) for part in version.split("-")[0].split(".")[:2])
    assert (major, minor) >= (2, 26), version


def test_a_second_run_finds_every_image_up_to_date() -> None:
    first = setup("images")
    assert first.returncode == 0, first.stderr
    again = setup("images")
    assert again.returncode == 0, again.stderr
    assert "building" not in again.stderr, again.stderr
    # Redis, Prometheus and draftline say so; the base, the first step, says nothing when it is current.
    assert again.stderr.count("is up to date") == 3, again.stderr
    for tag in IMAGES:
        assert len(inputs_label(tag)) == 64, tag  # a sha256 of the image's inputs


def test_an_image_whose_inputs_changed_is_built_again() -> None:
    """Tagged under a name of its own with another image's label, the Redis image counts as built from other
    inputs: the script builds it (from Docker's layer cache), then finds it up to date."""
    tag = f"draftline-redis:test-{os.getpid()}"
    # An image an earlier build left untagged, of inputs no image has now: the next build removes it.
    left = subprocess.run(["docker", "build", "-q", "--label", f"{LABEL}=stale-{os.getpid()}", "-"],
                          input=f"FROM draftline-base:bookworm\nLABEL stale={os.getpid()}\n", capture_output=True,
                          text=True, check=True, env={**os.environ, "DOCKER_BUILDKIT": "0"}).stdout.strip()
    try:
        subprocess.run(["docker", "tag", "draftline-prometheus:bookworm", tag], check=True, capture_output=True)
        stale = setup("images", DRAFTLINE_REDIS_IMAGE=tag)
        assert stale.returncode == 0, stale.stderr
        assert f"building {tag}" in stale.stderr, stale.stderr
        assert inputs_label(tag) == inputs_label("draftline-redis:bookworm")
        assert inputs_label(tag) != inputs_label("draftline-prometheus:bookworm")
        fresh = setup("images", DRAFTLINE_REDIS_IMAGE=tag)
        assert f"{tag} is up to date" in fresh.stderr, fresh.stderr
        # What a build leaves untagged is pruned, but for the build stages of the images' current inputs.
        current = {inputs_label(image) for image in IMAGES}
        untagged = subprocess.run(["docker", "images", "-q", "--filter", "dangling=true", "--filter", f"label={LABEL}"],
                                  capture_output=True, text=True, check=True).stdout.split()
        assert {inputs_label(image) for image in untagged} <= current
        assert subprocess.run(["docker", "image", "inspect", left], capture_output=True).returncode != 0
    finally:
        subprocess.run(["docker", "image", "rm", tag, left], capture_output=True)


def test_a_client_without_compose_reads_as_missing_compose_not_as_an_error(tmp_path) -> None:
    """On a fresh machine `docker compose` is an unknown command (exit 125). Under the script's ``set -euo
    pipefail`` that status once ended the whole script, silently, before Compose was installed. A stand-in
    ``docker`` that answers as such a client checks the script's own function."""
    shim = tmp_path / "bin" / "docker"
    shim.parent.mkdir()
    shim.write_text("#!/bin/sh\necho \"docker: unknown command: docker $1\" >&2\nexit 125\n")
    shim.chmod(0o755)
    function = next(line for line in SCRIPT.read_text().splitlines() if line.startswith("compose_version()"))
    probe = f'set -euo pipefail\n{function}\nversion=$(compose_version)\necho "version=[$version]"\n'
    result = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30,
                            env={**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "version=[]"
