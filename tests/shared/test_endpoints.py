"""Endpoint lists in settings: one URL or several, a bad list refused by name."""

from __future__ import annotations


import pytest

from shared.endpoints import EndpointListError, parse_endpoints
from shared.errors import SettingsError
from shared.settings import (
    ControllerSettings,
    ExtractorSettings,
    GeneratorSettings,
    load_settings,
)


def test_one_url_or_a_comma_separated_list_reads_as_server_roots():
    assert parse_endpoints("http://127.0.0.1:8000") == ("http://127.0.0.1:8000",)
    assert parse_endpoints(" http://gpu0:8000/v1/ , https://gpu1:8000/,http://gpu2:8000") == (
        "http://gpu0:8000", "https://gpu1:8000", "http://gpu2:8000")


@pytest.mark.parametrize(("value", "message"), [
    ("", "the URL is empty"),
    ("http://a:1,,http://b:1", "entry 2 of 3 is empty"),
    ("http://a:1,", "entry 2 of 2 is empty"),
    ("ftp://a:1", "the URL ('ftp://a:1') is not an http:// or https:// URL"),
    ("http://a:1,gpu1:8000", "entry 2 of 2 ('gpu1:8000') is not an http:// or https:// URL"),
    ("http://:8000", "is not an http:// or https:// URL with a host"),
    ("http://a:1,http://b:1,http://a:1/v1", "entry 3 of 3 ('http://a:1/v1') repeats http://a:1"),
])
def test_a_bad_list_is_refused_naming_the_entry(value, message):
    with pytest.raises(EndpointListError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_endpoints(value)


def test_settings_take_a_list_from_the_environment_and_refuse_a_bad_one_naming_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTLINE_INFERENCE_URL", "http://gpu0:8000, http://gpu1:8000")
    monkeypatch.setenv("DRAFTLINE_HIDDEN_STATES_URL", "http://gpu0:8000")
    monkeypatch.setenv("DRAFTLINE_MODEL_DIR", str(tmp_path))
    generator = load_settings(GeneratorSettings)
    assert parse_endpoints(generator.inference_url) == ("http://gpu0:8000", "http://gpu1:8000")
    assert parse_endpoints(load_settings(ControllerSettings).inference_url) == ("http://gpu0:8000", "http://gpu1:8000")
    assert load_settings(ExtractorSettings).hidden_states_url == "http://gpu0:8000"  # one URL, unchanged

    monkeypatch.setenv("DRAFTLINE_HIDDEN_STATES_URL", "http://gpu0:8000,http://gpu0:8000/")
    with pytest.raises(SettingsError, match=r"DRAFTLINE_HIDDEN_STATES_URL: .*repeats http://gpu0:8000"):
        load_settings(ExtractorSettings)
    monkeypatch.setenv("DRAFTLINE_INFERENCE_URL", "http://gpu0:8000,")
    for cls in (GeneratorSettings, ControllerSettings):
        with pytest.raises(SettingsError, match=r"DRAFTLINE_INFERENCE_URL: .*entry 2 of 2 is empty"):
            load_settings(cls)
