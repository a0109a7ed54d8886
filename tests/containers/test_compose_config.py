"""Every layout the README names, read by the real Docker Compose (`docker compose config`) with its example
.env: Compose accepts it, and what it makes of each service is what tests/test_compose.py's own reading
checked (so those checks hold for the files as Compose really merges and interpolates them)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support.compose import compose_missing
from tests.support.processes import REPO
from tests.test_compose import PROJECTS, environment, interpolate, load_project, project_env

pytestmark = pytest.mark.containers


def compose_config(project: str, tmp_path) -> dict:
    """``docker compose config --format json`` of the project's files with every profile enabled."""
    env_file = tmp_path / ".env"
    env_file.write_text("".join(f"{name}={value}\n" for name, value in project_env(project).items()))
    model = interpolate(load_project(project), project_env(project))
    profiles = sorted({p for service in model["services"].values() for p in service.get("profiles", [])})
    argv = ["docker", "compose", "--env-file", str(env_file), "-p", f"config-{project}",
            *(arg for name in PROJECTS[project] for arg in ("-f", str(REPO / name))),
            *(arg for profile in profiles for arg in ("--profile", profile)), "config", "--format", "json"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, f"docker compose config refuses {project}:\n{done.stderr}"
    return json.loads(done.stdout)


@pytest.fixture(scope="module", autouse=True)
def _compose_present() -> None:
    # Only the Compose plugin is needed here, not a running engine.
    if why := compose_missing():
        pytest.fail(why, pytrace=False)


@pytest.mark.parametrize("project", list(PROJECTS))
def test_compose_reads_every_layout_as_our_checks_do(project: str, tmp_path) -> None:
    real = compose_config(project, tmp_path)["services"]
    ours = interpolate(load_project(project), project_env(project))["services"]
    assert set(real) == set(ours)
    for name, service in ours.items():
        got = real[name]
        assert got.get("image") == service.get("image"), name
        assert got.get("user") == service.get("user"), name
        for key in ("command", "entrypoint"):
            if key in service:
                assert got[key] == service[key], (name, key)
        # Compose leaves out a variable passed through from an unset one; every value set agrees.
        real_env = {k: v for k, v in (got.get("environment") or {}).items() if v is not None}
        assert real_env == environment(service), name
        if "healthcheck" in service:
            assert got["healthcheck"]["test"] == service["healthcheck"]["test"], name
        devices = (service.get("deploy") or {}).get("resources", {}).get("reservations", {}).get("devices", [])
        real_devices = (got.get("deploy") or {}).get("resources", {}).get("reservations", {}).get("devices", [])
        assert [d.get("device_ids") for d in real_devices] == [d.get("device_ids") for d in devices], name
