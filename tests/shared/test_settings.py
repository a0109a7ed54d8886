import re
import subprocess
from pathlib import Path

import pytest

from shared.errors import SettingsError, UnknownSetting
from shared.settings import (
    ExtractorSettings,
    GeneratorSettings,
    InferenceSettings,
    env_name,
    known_variables,
    load_settings,
)

REPO = Path(__file__).resolve().parents[2]
VARIABLE = re.compile(r"DRAFTLINE_[A-Z0-9_]+")


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://example:1/2")
    monkeypatch.setenv("DRAFTLINE_CONCURRENCY", "32")
    settings = load_settings(GeneratorSettings)
    assert settings.redis_url == "redis://example:1/2"
    assert settings.concurrency == 32


def test_a_missing_required_setting_names_its_variable(monkeypatch):
    monkeypatch.delenv("DRAFTLINE_MODEL_DIR", raising=False)
    with pytest.raises(SettingsError, match="DRAFTLINE_MODEL_DIR"):
        load_settings(ExtractorSettings)


def test_an_invalid_value_names_its_variable(monkeypatch):
    monkeypatch.setenv("DRAFTLINE_CONCURRENCY", "zero")
    with pytest.raises(SettingsError, match="DRAFTLINE_CONCURRENCY"):
        load_settings(GeneratorSettings)


def test_env_names_follow_prefix_or_alias():
    assert env_name(GeneratorSettings, "redis_url") == "REDIS_URL"
    assert env_name(GeneratorSettings, "inference_url") == "DRAFTLINE_INFERENCE_URL"


# Misspellings are built from the right names, so that no misspelt name lies in the tree (see the last test).
MISSPELT_BATCH = "DRAFTLINE_MAX_BATCH_SIZE".replace("SIZE", "SZIE")
MISSPELT_CONCURRENCY = "DRAFTLINE_CONCURRENCY".replace("RR", "R")


def test_a_misspelt_variable_stops_the_service_and_names_the_right_one(monkeypatch):
    monkeypatch.setenv(MISSPELT_BATCH, "32")
    with pytest.raises(UnknownSetting, match=f"{MISSPELT_BATCH} .*did you mean DRAFTLINE_MAX_BATCH_SIZE"):
        load_settings(InferenceSettings, model_dir=".")


def test_a_misspelt_variable_in_the_env_file_stops_the_service(monkeypatch, tmp_path):
    (tmp_path / ".env").write_text(f"{MISSPELT_CONCURRENCY}=32\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnknownSetting, match=rf"{MISSPELT_CONCURRENCY} in the \.env file .*DRAFTLINE_CONCURRENCY"):
        load_settings(GeneratorSettings)


def test_another_components_variables_do_not_stop_a_service(monkeypatch, tmp_path):
    # One environment serves every service, compose and the tools: a trainer setting, a compose variable and
    # a test variable reach the generator too.
    monkeypatch.setenv("DRAFTLINE_TRAIN_PROCS", "2")
    monkeypatch.setenv("DRAFTLINE_REDIS_WORKER_PASSWORD", "secret")
    monkeypatch.setenv("DRAFTLINE_TEST_CACHE", str(tmp_path))
    (tmp_path / ".env").write_text("DRAFTLINE_IMAGE=draftline:test\nDRAFTLINE_MODEL_DIR_HOST=/models\n")
    monkeypatch.chdir(tmp_path)
    assert load_settings(GeneratorSettings).concurrency == 8


def test_every_draftline_variable_in_the_repository_is_known():
    # So the list of known names cannot drift from the code, compose files, scripts and documentation.
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    found: dict[str, str] = {}
    for path in filter(None, files.decode().split("\0")):
        file = REPO / path
        if file.is_file():
            for name in VARIABLE.findall(file.read_text(errors="replace")):
                found.setdefault(name, path)
    assert "DRAFTLINE_MAX_BATCH_SIZE" in found  # the scan reads the tree
    known = known_variables()
    # A name ending in "_" is a prefix (tests/support/processes.py drops DRAFTLINE_REDIS_*), not a variable.
    unknown = {name: path for name, path in found.items()
               if not (any(k.startswith(name) for k in known) if name.endswith("_") else name in known)}
    assert not unknown, f"DRAFTLINE_ names that no settings class or OTHER_VARIABLES knows: {unknown}"
