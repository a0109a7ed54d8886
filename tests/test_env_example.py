""".env.example documents every setting and every compose variable, and nothing else."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

import shared.settings
from shared.settings import env_name, load_settings
from tests.test_compose import (
    LAYOUT_ENV,
    PROJECTS,
    WORKER_HOST_FILE,
    all_passed_through_variables,
    all_referenced_variables,
    load_compose,
    read_compose,
    referenced_variables,
)

ENV_EXAMPLE = Path(__file__).resolve().parents[1] / ".env.example"
VARIABLE_LINE = re.compile(r"^(?P<commented>#\s*)?(?P<name>[A-Z][A-Z0-9_]*)=(?P<value>.*)$")


def settings_classes() -> list[type[BaseSettings]]:
    return [
        cls
        for _, cls in inspect.getmembers(shared.settings, inspect.isclass)
        if issubclass(cls, BaseSettings) and cls.__module__ == shared.settings.__name__
    ]


def settings_variables() -> set[str]:
    return {env_name(cls, field) for cls in settings_classes() for field in cls.model_fields}


def documented() -> dict[str, tuple[str, bool]]:
    """Name -> (example value, whether the line is active rather than commented out)."""
    found = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        match = VARIABLE_LINE.match(line)
        if match:
            assert match.group("name") not in found, f"{match.group('name')} documented twice"
            found[match.group("name")] = (match.group("value"), match.group("commented") is None)
    return found


def test_every_setting_is_documented() -> None:
    missing = settings_variables() - set(documented())
    assert not missing, f"settings without a line in .env.example: {sorted(missing)}"


def test_every_compose_variable_is_documented() -> None:
    # Both ${VAR} references and the names compose passes through from .env to a container.
    missing = (set(all_referenced_variables()) | all_passed_through_variables()) - set(documented())
    assert not missing, f"compose file variables without a line in .env.example: {sorted(missing)}"


def test_nothing_is_documented_that_no_setting_or_compose_file_reads() -> None:
    read = settings_variables() | set(all_referenced_variables()) | all_passed_through_variables()
    stale = set(documented()) - read
    assert not stale, f".env.example documents variables nothing reads: {sorted(stale)}"


def test_required_compose_variables_are_active_and_empty_until_filled_in() -> None:
    # An empty required value makes `docker compose` stop with its message instead of starting half-set.
    required = {name for name, needed in referenced_variables(load_compose()).items() if needed}
    assert required
    for name in required:
        assert documented()[name] == ("", True), name
    for name, (_, active) in documented().items():
        assert active == (name in required), f"{name}: only required variables are active lines"


def comment_of(name: str) -> str:
    """The comment lines right above ``name``'s line."""
    lines = ENV_EXAMPLE.read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if (m := VARIABLE_LINE.match(line)) and m.group("name") == name)
    above = []
    for line in reversed(lines[:index]):
        if not line.startswith("#") or VARIABLE_LINE.match(line):
            break
        above.insert(0, line)
    return " ".join(above)


def test_what_a_worker_host_requires_is_documented_as_required_there() -> None:
    main_required = {name for name, needed in referenced_variables(load_compose()).items() if needed}
    worker_required = {name for name, needed in referenced_variables(read_compose(
        ENV_EXAMPLE.parent / WORKER_HOST_FILE)).items() if needed}
    assert "REDIS_URL" in worker_required
    for name in worker_required - main_required:
        assert "REQUIRED on a worker host" in comment_of(name), name
        assert WORKER_HOST_FILE in comment_of(name), name


OVERRIDE_LAYOUTS = [project for project, files in PROJECTS.items() if files[0] == "docker-compose.yml" and files[1:]]


@pytest.mark.parametrize("project", OVERRIDE_LAYOUTS)
def test_what_a_layout_requires_is_documented_as_required_with_its_file(project: str) -> None:
    main_required = {name for name, needed in referenced_variables(load_compose()).items() if needed}
    (layout,) = PROJECTS[project][1:]
    required = {name for name, needed in referenced_variables(read_compose(ENV_EXAMPLE.parent / layout)).items()
                if needed} - main_required
    assert required == set(LAYOUT_ENV.get(project, {}))  # what the compose tests fill in for that layout
    for name in required:
        assert f"REQUIRED with {layout}" in comment_of(name), name


def test_every_variable_has_a_comment_above_it() -> None:
    lines = ENV_EXAMPLE.read_text().splitlines()
    for i, line in enumerate(lines):
        if VARIABLE_LINE.match(line):
            above = lines[i - 1] if i else ""
            assert above.startswith("#") and not VARIABLE_LINE.match(above), f"{line!r} has no comment of its own"


@pytest.mark.parametrize("cls", settings_classes(), ids=lambda cls: cls.__name__)
def test_documented_values_are_valid_and_are_the_defaults(cls: type[BaseSettings], monkeypatch, tmp_path) -> None:
    """Each "# NAME=value" line passes the settings' validation and shows the default it claims to."""
    examples = {name: value for name, (value, _) in documented().items() if value}
    for field in cls.model_fields:
        monkeypatch.delenv(env_name(cls, field), raising=False)
    for name, value in examples.items():
        monkeypatch.setenv(name, value)
    fields = cls.model_fields.items()
    required = {f: tmp_path for f, info in fields if info.is_required() and env_name(cls, f) not in examples}
    monkeypatch.chdir(tmp_path)  # no .env from the working directory
    settings = load_settings(cls, **required)
    for field, info in fields:
        if env_name(cls, field) in examples and not info.is_required() and info.default is not None:
            assert getattr(settings, field) == info.default, env_name(cls, field)
