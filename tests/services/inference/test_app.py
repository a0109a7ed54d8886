"""``create_app`` in-process: several apps in one process keep separate metrics and share a loaded target."""

from fastapi.testclient import TestClient

from services.inference.app import create_app
from shared.settings import InferenceSettings


def request_count(client: TestClient, endpoint: str) -> float:
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("draftline_inference_requests_total{") and f'endpoint="{endpoint}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_two_apps_in_one_process_count_their_own_requests(loaded_tiny, tiny_model_dir, tmp_path):
    settings = InferenceSettings(model_dir=tiny_model_dir, data=tmp_path, device="cpu")
    with TestClient(create_app(settings, loaded=loaded_tiny)) as first, \
            TestClient(create_app(settings, loaded=loaded_tiny)) as second:
        for _ in range(3):
            assert first.get("/health").json()["status"] == "ok"
        assert second.get("/health").status_code == 200
        assert request_count(first, "/health") == 3
        assert request_count(second, "/health") == 1


def test_unknown_route_is_counted_without_its_raw_path(loaded_tiny, tiny_model_dir, tmp_path):
    settings = InferenceSettings(model_dir=tiny_model_dir, data=tmp_path, device="cpu")
    with TestClient(create_app(settings, loaded=loaded_tiny)) as client:
        assert client.get("/no/such/route/123").status_code == 404
        metrics = client.get("/metrics").text
    assert 'endpoint="unmatched",status="404"' in metrics
    assert "/no/such/route" not in metrics
