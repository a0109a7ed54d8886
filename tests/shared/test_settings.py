import pytest

from shared.errors import SettingsError
from shared.settings import ExtractorSettings, GeneratorSettings, env_name, load_settings


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
