"""The served-model lookup and preflight's inference check over a list of endpoints, against real servers."""

from __future__ import annotations

import pytest

from services.controller.runs import preflight as pf
from services.controller.runs.served import served_model
from shared.errors import InferenceUnavailable
from shared.settings import ControllerSettings
from tests.support.openai_server import OpenAIServer
from tests.support.processes import free_port


def check(tmp_path, urls: str) -> pf.Check:
    return pf.check_inference(ControllerSettings(data=tmp_path, inference_url=urls), None, pf.Facts())


def test_the_first_endpoint_that_answers_names_the_model():
    dead = f"http://127.0.0.1:{free_port()}"
    with OpenAIServer(model="target") as live:
        assert served_model(f"{dead},{live.url}/v1") == "target"
    with pytest.raises(InferenceUnavailable, match=rf"{dead}/v1/models nor .* does not say which one it serves"):
        served_model(f"{dead},{live.url}")  # both gone now


def test_preflight_passes_only_when_every_endpoint_serves_the_same_model_and_names_the_one_that_does_not(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    with OpenAIServer(model="target") as a, OpenAIServer(model="target") as b, OpenAIServer(model="other") as c:
        ok = check(tmp_path, f"{a.url},{b.url}")
        assert ok.ok and ok.message == f"all 2 endpoints ({a.url}, {b.url}) serve 'target'"
        assert check(tmp_path, a.url).message == f"{a.url} serves 'target'"
        other = check(tmp_path, f"{a.url},{b.url},{c.url}")
        assert not other.ok and other.severity == pf.ERROR
        assert other.message.startswith(f"{c.url} does not serve the model {a.url} serves ('target'")
        assert "['other']" in other.message and c.url in other.fix
        gone = check(tmp_path, f"{a.url},{dead}")
        assert not gone.ok and gone.message.startswith(f"{dead}/v1/models does not answer")
