"""docker-compose.yml, the Dockerfile and the monitoring files agree with the schema, with the code and
with each other. Docker itself is not needed: the file is read and interpolated the way Compose does."""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from shared.services import SERVICE_COMMANDS, SERVICE_NAMES
from shared.settings import ExtractorSettings, GeneratorSettings

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
SCHEMA_FILE = REPO / "tests" / "data" / "compose-spec.json"
PROMETHEUS_FILE = REPO / "prometheus" / "prometheus.yml"
DATASOURCE_FILE = REPO / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDER_FILE = REPO / "grafana" / "provisioning" / "dashboards" / "draftline.yml"
DASHBOARDS_DIR = REPO / "grafana" / "dashboards"
DATASOURCE_UID = "draftline-prometheus"
SCALABLE = ("generator", "extractor")
GPU_SERVICES = ("inference", "trainer", "vllm", "sglang")

# Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?message}, ${VAR?message}; $$ is a literal $.
_REFERENCE = re.compile(r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\})")
EXAMPLE_ENV = {
    "REDIS_PASSWORD": "s3cret-pw",
    "DRAFTLINE_DATA_DIR": "/mnt/nvme/draftline",
    "DRAFTLINE_MODEL_DIR_HOST": "/mnt/nvme/models/target",
    "GRAFANA_ADMIN_PASSWORD": "grafana-pw",
}


class MissingVariable(ValueError):
    """A ``${VAR:?message}`` reference found VAR unset or empty."""


# ---- reading the files the way Compose does -------------------------------------------------------
def load_compose() -> dict:
    """The file as YAML: anchors and merge keys resolved, ``${VAR}`` references still in place."""
    return yaml.safe_load(COMPOSE_FILE.read_text())


def strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, Mapping):
        for key, value in node.items():
            yield from strings(key)
            yield from strings(value)
    elif isinstance(node, list):
        for item in node:
            yield from strings(item)


def referenced_variables(doc: dict) -> dict[str, bool]:
    """Every ``${VAR}`` in the document -> whether some reference requires it (``?``)."""
    found: dict[str, bool] = {}
    for text in strings(doc):
        for match in _REFERENCE.finditer(text):
            if match.group("name"):
                name = match.group("name")
                found[name] = found.get(name, False) or "?" in (match.group("op") or "")
    return found


def interpolate(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return _REFERENCE.sub(lambda m: _substitute(m, env), node)
    if isinstance(node, Mapping):
        return {interpolate(k, env): interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(item, env) for item in node]
    return node


def _substitute(match: re.Match, env: Mapping[str, str]) -> str:
    name, op, arg = match.group("name"), match.group("op"), match.group("arg")
    if name is None:
        return "$"
    value = env.get(name)
    missing = value is None or (value == "" and op is not None and op.startswith(":"))
    if op in (":-", "-"):
        return arg if missing else value
    if op in (":?", "?"):
        if missing:
            raise MissingVariable(f"{name}: {arg}")
    return value or ""


@pytest.fixture(scope="module")
def raw() -> dict:
    return load_compose()


@pytest.fixture(scope="module")
def compose(raw: dict) -> dict:
    return interpolate(raw, EXAMPLE_ENV)


@pytest.fixture(scope="module")
def services(compose: dict) -> dict:
    return compose["services"]


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    assert isinstance(env, dict), "environment is written as a mapping so the x-draftline anchor can merge"
    return {k: str(v) for k, v in env.items()}


def gpu_devices(service: dict) -> list[dict]:
    reservations = (service.get("deploy") or {}).get("resources", {}).get("reservations", {})
    return [d for d in reservations.get("devices", []) if "gpu" in d.get("capabilities", [])]


def duration_seconds(text: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a compose duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


# ---- schema ---------------------------------------------------------------------------------------
def test_compose_file_matches_the_compose_spec_schema(raw: dict, compose: dict) -> None:
    import jsonschema

    schema = json.loads(SCHEMA_FILE.read_text())
    validator = jsonschema.Draft7Validator(schema)
    for doc in (raw, compose):
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_interpolation_stops_without_the_required_secrets_and_paths(raw: dict) -> None:
    required = {name for name, needed in referenced_variables(raw).items() if needed}
    assert required == set(EXAMPLE_ENV)
    for name in EXAMPLE_ENV:
        env = {k: v for k, v in EXAMPLE_ENV.items() if k != name}
        with pytest.raises(MissingVariable, match=name):
            interpolate(raw, env)
        with pytest.raises(MissingVariable, match=name):
            interpolate(raw, {**env, name: ""})


# ---- draftline services ---------------------------------------------------------------------------
def test_every_draftline_service_runs_its_command_from_the_shared_table(services: dict) -> None:
    for name in SERVICE_NAMES:
        assert services[name]["command"] == SERVICE_COMMANDS[name], name
        # `draftline serve NAME` imports services.NAME.main; check the file, not the import (heavy).
        assert (REPO / "services" / name / "main.py").is_file(), f"services/{name}/main.py missing"


def test_draftline_services_share_the_common_settings_of_the_anchor(raw: dict, services: dict) -> None:
    common = interpolate(raw["x-draftline"], EXAMPLE_ENV)
    for name in SERVICE_NAMES:
        service = services[name]
        for key in ("image", "build", "user", "init", "restart", "env_file"):
            assert service[key] == common[key], f"{name}.{key}"
        env = environment(service)
        assert env["DRAFTLINE_DATA"] == "/data", name
        assert "data:/data" in service["volumes"], name


def test_redis_url_carries_the_password_to_the_redis_service(services: dict) -> None:
    password = EXAMPLE_ENV["REDIS_PASSWORD"]
    for name in SERVICE_NAMES:
        url = urlsplit(environment(services[name])["REDIS_URL"])
        assert (url.scheme, url.hostname, url.port, url.password) == ("redis", "redis", 6379, password), name
    redis = services["redis"]
    assert redis["command"][redis["command"].index("--requirepass") + 1] == password
    assert environment(redis)["REDISCLI_AUTH"] == password  # the healthcheck's redis-cli authenticates


def test_redis_persists_to_a_named_volume(compose: dict, services: dict) -> None:
    redis = services["redis"]
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    volume = next(v.split(":")[0] for v in redis["volumes"] if v.split(":")[1] == "/data")
    assert volume in compose["volumes"]


def test_data_volume_binds_the_host_path_from_env(compose: dict) -> None:
    data = compose["volumes"]["data"]
    assert data["driver_opts"] == {"type": "none", "o": "bind", "device": EXAMPLE_ENV["DRAFTLINE_DATA_DIR"]}


def test_model_directory_is_mounted_read_only_where_it_is_read(services: dict) -> None:
    mount = f"{EXAMPLE_ENV['DRAFTLINE_MODEL_DIR_HOST']}:/models/target:ro"
    for name in ("inference", "extractor", "trainer", "vllm", "sglang"):
        assert mount in services[name]["volumes"], name
    for name in ("inference", "extractor", "trainer"):
        assert environment(services[name])["DRAFTLINE_MODEL_DIR"] == "/models/target", name


def test_every_service_runs_as_a_non_root_user(services: dict) -> None:
    for name, service in services.items():
        user = str(service.get("user", ""))
        assert user and user.split(":")[0] not in ("root", "0"), f"{name} runs as {user or 'the image default'}"


def test_images_are_pinned(services: dict) -> None:
    for name, service in services.items():
        if "build" in service:
            continue  # built from this repository
        image = service["image"]
        tag = image.rpartition(":")[2] if ":" in image.rpartition("/")[2] else ""
        assert tag and tag != "latest" and not tag.startswith("latest-"), f"{name}: {image} is not pinned"


# ---- GPUs ------------------------------------------------------------------------------------------
def test_gpu_reservations_name_the_gpu_capability_and_count_or_ids_never_both(services: dict) -> None:
    for name, service in services.items():
        for device in gpu_devices(service):
            assert device.get("driver") == "nvidia", name
            assert ("count" in device) != ("device_ids" in device), f"{name}: count and device_ids are exclusive"
            if "device_ids" in device:
                assert device["device_ids"] and all(isinstance(i, str) for i in device["device_ids"]), name
    for name in GPU_SERVICES:
        assert gpu_devices(services[name]), f"{name} reserves no GPU"


def test_generation_servers_are_optional_profiles_on_their_own_gpus(services: dict) -> None:
    for name in ("vllm", "sglang"):
        assert services[name]["profiles"] == [name]
        assert "--served-model-name" in services[name]["command"]
        port = services[name]["command"][services[name]["command"].index("--port") + 1]
        assert port == "8000", name
    # The built-in server and every draftline service run without a profile.
    for name in (*SERVICE_NAMES, "redis", "prometheus", "grafana"):
        assert "profiles" not in services[name], name
    # The generator follows DRAFTLINE_INFERENCE_URL; hidden states always come from the built-in server.
    assert environment(services["generator"])["DRAFTLINE_INFERENCE_URL"] == "http://inference:8000"
    override = interpolate(load_compose(), {**EXAMPLE_ENV, "DRAFTLINE_INFERENCE_URL": "http://vllm:8000"})
    assert environment(override["services"]["generator"])["DRAFTLINE_INFERENCE_URL"] == "http://vllm:8000"
    assert environment(services["extractor"])["DRAFTLINE_HIDDEN_STATES_URL"] == "http://inference:8000"


# ---- health and start-up order --------------------------------------------------------------------
def test_every_service_healthy_dependency_has_a_healthcheck(services: dict) -> None:
    checked = 0
    for name, service in services.items():
        for dependency, spec in (service.get("depends_on") or {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            if spec.get("condition") == "service_healthy":
                check = services[dependency].get("healthcheck") or {}
                assert check.get("test") and not check.get("disable"), f"{name} waits for {dependency}'s health"
                checked += 1
    assert checked >= len(SERVICE_NAMES)


def test_optional_generation_servers_are_optional_dependencies(services: dict) -> None:
    for name in ("vllm", "sglang"):
        assert services["generator"]["depends_on"][name]["required"] is False


def test_http_healthchecks_ask_the_port_the_service_listens_on(services: dict) -> None:
    for name in ("inference", "controller", "exporter"):
        port = environment(services[name])["DRAFTLINE_PORT"]
        assert services[name]["healthcheck"]["test"][-1] == f"http://127.0.0.1:{port}/health", name
    assert environment(services["inference"])["DRAFTLINE_PORT"] == "8000"


# ---- scalable workers -----------------------------------------------------------------------------
def test_scalable_workers_have_no_fixed_name_or_host_port(services: dict) -> None:
    for name in SCALABLE:
        assert "container_name" not in services[name], name
        assert "ports" not in services[name], name


def test_workers_get_time_to_finish_a_job_on_stop(services: dict) -> None:
    # A job can wait one full request timeout on the inference server; docker stop must not cut it.
    for name, settings in (("generator", GeneratorSettings), ("extractor", ExtractorSettings)):
        timeout = settings.model_fields["request_timeout_s"].default
        assert duration_seconds(services[name]["stop_grace_period"]) >= timeout, name
    assert duration_seconds(services["trainer"]["stop_grace_period"]) >= 60


# ---- Prometheus and Grafana -----------------------------------------------------------------------
def container_port(service: dict) -> str:
    env = environment(service)
    if "DRAFTLINE_PORT" in env:
        return env["DRAFTLINE_PORT"]
    command = service["command"]
    return command[command.index("--port") + 1]


def test_prometheus_scrape_targets_are_compose_services_and_ports(services: dict) -> None:
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    active = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    # The vllm and sglang jobs ship commented out; they must be right once uncommented.
    commented = re.findall(r"^\s*#\s*- targets: \[\"([^\"]+)\"\]", PROMETHEUS_FILE.read_text(), re.MULTILINE)
    assert set(active) >= {"exporter:9400", "inference:8000"}
    assert set(commented) == {"vllm:8000", "sglang:8000"}
    for target in active + commented:
        host, port = target.split(":")
        assert host in services, target
        assert container_port(services[host]) == port, target


def test_prometheus_loads_the_alert_rules_shipped_beside_it(services: dict) -> None:
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    for rule_file in config["rule_files"]:
        assert (PROMETHEUS_FILE.parent / rule_file).is_file(), rule_file
    assert "./prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]


def bind_mounts(service: dict) -> dict[str, str]:
    """Container path -> repository path of each ``./…`` bind mount; all must be read-only."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        if source.startswith("./"):
            assert mode == ["ro"], f"{volume} is mounted writable"
            mounts[target] = source
    return mounts


def test_grafana_provisioning_mounts_exist_in_the_repository(services: dict) -> None:
    mounts = bind_mounts(services["grafana"])
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    for source in (*mounts.values(), *bind_mounts(services["prometheus"]).values()):
        assert (REPO / source).is_dir(), source
    provider = yaml.safe_load(DASHBOARD_PROVIDER_FILE.read_text())["providers"][0]
    assert provider["type"] == "file"
    dashboards_in_container = provider["options"]["path"]
    assert (REPO / mounts[dashboards_in_container]).resolve() == DASHBOARDS_DIR.resolve()
    home = environment(services["grafana"])["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (DASHBOARDS_DIR / Path(home).relative_to(dashboards_in_container)).is_file()


def test_grafana_requires_an_admin_password(raw: dict) -> None:
    reference = raw["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert reference.startswith("${GRAFANA_ADMIN_PASSWORD:?")


def test_datasource_has_a_fixed_uid_and_the_scrape_interval(services: dict) -> None:
    datasource = yaml.safe_load(DATASOURCE_FILE.read_text())["datasources"][0]
    assert datasource["uid"] == DATASOURCE_UID and datasource["type"] == "prometheus"
    scrape_interval = yaml.safe_load(PROMETHEUS_FILE.read_text())["global"]["scrape_interval"]
    assert datasource["jsonData"]["timeInterval"] == scrape_interval
    url = urlsplit(datasource["url"])
    assert url.hostname in services and url.port == 9090


def dashboards() -> list[tuple[Path, dict]]:
    found = [(path, json.loads(path.read_text())) for path in sorted(DASHBOARDS_DIR.glob("*.json"))]
    assert found, "no dashboards"
    return found


def datasource_refs(node: Any) -> Iterator[Any]:
    """Every ``datasource`` value anywhere in a dashboard."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield value
            else:
                yield from datasource_refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from datasource_refs(item)


def test_dashboards_have_fixed_unique_uids() -> None:
    uids = [dash.get("uid") for _, dash in dashboards()]
    assert all(uids) and len(set(uids)) == len(uids)


def test_every_panel_and_query_names_the_provisioned_datasource_by_uid() -> None:
    for path, dash in dashboards():
        panels = dash["panels"]
        assert panels, path.name
        for panel in panels:
            assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}, (path.name, panel["title"])
            assert panel["targets"], (path.name, panel["title"])
        refs = list(datasource_refs(dash))
        assert refs and all(ref == {"type": "prometheus", "uid": DATASOURCE_UID} for ref in refs), path.name


def test_panel_ids_are_unique_and_laid_out() -> None:
    for path, dash in dashboards():
        ids = [panel["id"] for panel in dash["panels"]]
        assert len(set(ids)) == len(ids), path.name
        for panel in dash["panels"]:
            assert set(panel["gridPos"]) == {"x", "y", "w", "h"}, (path.name, panel["title"])


# ---- Dockerfile and build context -----------------------------------------------------------------
def dockerfile_stages() -> list[list[str]]:
    """Instructions per stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def test_dockerfile_is_multi_stage_and_runs_as_a_non_root_user() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2
    users = [line.split()[1] for line in stages[-1] if line.upper().startswith("USER ")]
    assert users and users[-1] not in ("root", "0")


def test_dockerfile_installs_torch_from_the_chosen_index_before_the_project() -> None:
    runs = [line for stage in dockerfile_stages() for line in stage if line.upper().startswith("RUN ")]
    torch = next(i for i, line in enumerate(runs) if "torch==" in line)
    project = next(i for i, line in enumerate(runs) if re.search(r"pip install \.(\s|$)", line))
    assert torch < project
    assert "--index-url" in runs[torch] and "${TORCH_VARIANT}" in runs[torch]
    instructions = " ".join(line for stage in dockerfile_stages() for line in stage)
    assert "[test]" not in instructions and "pytest" not in instructions


def dockerignored(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a folder covers its contents."""
    ignored = False
    for pattern in (REPO / ".dockerignore").read_text().splitlines():
        pattern = pattern.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/").replace("**/", "*")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes):
            ignored = not negate
    return ignored


def test_build_context_holds_the_package_and_nothing_else() -> None:
    for path in (".venv/bin/python", "data/runs/x/run.json", "tests/conftest.py", ".git/HEAD", ".env",
                 "services/exporter/__pycache__/main.cpython-311.pyc", "draftline.egg-info/PKG-INFO"):
        assert dockerignored(path), path
    for path in ("pyproject.toml", "README.md", "shared/settings.py", "shared/data/demo_prompts.jsonl",
                 "services/exporter/main.py"):
        assert not dockerignored(path), path
