"""Who may call the controller: its API token, open or token-gated reads, and the listen-address rule,
against real ``draftline serve controller`` processes."""

from __future__ import annotations

import base64
import time

import httpx
import pytest
import redis

from tests.services.controller.api.test_api import controller_env
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.support.openai_server import OpenAIServer
from tests.support.processes import ServiceProcess, free_port

TOKEN = "test-token-0123456789abcdef"


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def start_controller(root, redis_url: str, inference_url: str, **settings: str) -> tuple[ServiceProcess, str]:
    data = root / "data"
    data.mkdir(exist_ok=True)
    port = free_port()
    env = {**controller_env(data, redis_url, port, inference_url), **settings}
    proc = ServiceProcess("controller", env=env, log_dir=root / "logs", health_url=f"http://127.0.0.1:{port}/health")
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def served():
    with OpenAIServer(model="served-name") as target:
        yield target


@pytest.fixture(scope="module")
def api(tmp_path_factory, redis_server, served):
    """A controller with a token and open reads (the default)."""
    root = tmp_path_factory.mktemp("api-auth")
    redis.Redis.from_url(redis_server.url).flushall()
    proc, url = start_controller(root, redis_server.url, served.url, DRAFTLINE_API_TOKEN=TOKEN)
    with proc:
        yield {"url": url, "root": root, "data": root / "data"}


@pytest.fixture(scope="module")
def gated(tmp_path_factory, redis_server, served):
    """A controller with a token that gates reads too."""
    root = tmp_path_factory.mktemp("api-auth-gated")
    proc, url = start_controller(root, redis_server.url, served.url, DRAFTLINE_API_TOKEN=TOKEN,
                                 DRAFTLINE_API_READS="token")
    with proc:
        yield {"url": url, "root": root}


def run_body(api, name: str) -> dict:
    dataset = write_jsonl(api["root"] / f"{name}.jsonl", [{"prompt": f"{name} {i}"} for i in range(4)])
    return {"dataset": str(dataset), "name": name, "model": "served-name", "evaluate": {"holdout": 1}}


def assert_refused(response: httpx.Response, status: int, *words: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    detail = response.json()["detail"]
    for word in words:
        assert word in detail, detail
    assert TOKEN not in response.text


# ---- mutating calls -----------------------------------------------------------------------------
def test_a_submission_without_the_token_is_401_and_says_how_to_send_it(api):
    response = httpx.post(f"{api['url']}/runs", json=run_body(api, "anonymous"), timeout=30)
    assert_refused(response, 401, "POST /runs", "Authorization: Bearer", "DRAFTLINE_API_TOKEN")
    assert response.headers["www-authenticate"] == 'Bearer realm="draftline"'
    assert not (api["data"] / "runs" / "anonymous").exists()


@pytest.mark.parametrize("headers", [
    bearer("wrong-token-0123456789abcdef"),
    bearer(TOKEN[:-1]),
    bearer(TOKEN + "x"),
])
def test_a_submission_with_a_wrong_token_is_403(api, headers):
    response = httpx.post(f"{api['url']}/runs", json=run_body(api, "wrong"), headers=headers, timeout=30)
    assert_refused(response, 403, "does not match", "DRAFTLINE_API_TOKEN")
    assert not (api["data"] / "runs" / "wrong").exists()


@pytest.mark.parametrize("headers", [{"Authorization": "Bearer"}, {"Authorization": "Token " + TOKEN},
                                     {"Authorization": "Basic not-base64!"}, {"X-Api-Token": TOKEN}])
def test_a_malformed_or_misplaced_credential_counts_as_none(api, headers):
    response = httpx.post(f"{api['url']}/runs", json=run_body(api, "malformed"), headers=headers, timeout=30)
    assert_refused(response, 401, "Authorization: Bearer")


def test_the_token_is_checked_before_the_body_is_read(api):
    # A caller without the token learns nothing about the request, not even that its body does not parse.
    broken = httpx.post(f"{api['url']}/runs", content=b"{not json", headers={"content-type": "application/json"},
                        timeout=30)
    assert_refused(broken, 401)
    huge = httpx.post(f"{api['url']}/runs", content=b"x" * (2 << 20), headers={"content-type": "application/json"},
                      timeout=30)
    assert_refused(huge, 401)
    other = httpx.request("DELETE", f"{api['url']}/runs/anything", timeout=30)
    assert_refused(other, 401, "DELETE /runs/anything")


def test_a_submission_with_the_token_is_201(api):
    response = httpx.post(f"{api['url']}/runs", json=run_body(api, "bearer"), headers=bearer(TOKEN), timeout=60)
    assert response.status_code == 201, response.text
    assert (api["data"] / "runs" / "bearer" / "run.json").is_file()


def test_basic_credentials_never_submit_a_run(api):
    # A browser resends cached Basic credentials by itself; another site's page must not submit runs with them.
    response = httpx.post(f"{api['url']}/runs", json=run_body(api, "basic"), headers=basic("anyone", TOKEN), timeout=30)
    assert_refused(response, 401, "Basic credentials count for reads only")
    assert not (api["data"] / "runs" / "basic").exists()


# ---- reads --------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/runs", "/runs/nope", "/preflight", "/status", "/health"])
def test_reads_are_open_by_default(api, path):
    response = httpx.get(f"{api['url']}{path}", timeout=60)
    assert response.status_code in (200, 404), response.text  # /runs/nope: there is no such run, openly


@pytest.mark.parametrize("path", ["/runs", "/runs/nope", "/runs/nope/failures", "/preflight", "/openapi.json"])
def test_gated_reads_need_the_token(gated, path):
    assert_refused(httpx.get(f"{gated['url']}{path}", timeout=30), 401, f"GET {path}")
    assert_refused(httpx.get(f"{gated['url']}{path}", headers=bearer("x" * 20), timeout=30), 403)
    response = httpx.get(f"{gated['url']}{path}", headers=bearer(TOKEN), timeout=60)
    assert response.status_code in (200, 404), response.text


def test_the_gated_status_page_asks_a_browser_for_the_token_as_a_password(gated):
    response = httpx.get(f"{gated['url']}/status", timeout=30)
    assert_refused(response, 401)
    assert response.headers["www-authenticate"] == 'Basic realm="draftline"'  # a browser prompts for Basic
    page = httpx.get(f"{gated['url']}/status", headers=basic("me", TOKEN), timeout=30)
    assert page.status_code == 200 and "<h1>draftline</h1>" in page.text
    assert_refused(httpx.get(f"{gated['url']}/status", headers=basic("me", "x" * 20), timeout=30), 403)


def test_health_stays_open_for_healthchecks_when_reads_are_gated(gated):
    response = httpx.get(f"{gated['url']}/health", timeout=30)
    assert response.status_code == 200 and response.json()["status"] == "ok"


# ---- start-up -----------------------------------------------------------------------------------
def wait_exit(proc: ServiceProcess, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while proc.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not proc.alive(), "the controller kept running"
    return proc.proc.returncode


def test_the_controller_refuses_to_listen_beyond_loopback_without_a_token(tmp_path, redis_url, served):
    proc, url = start_controller(tmp_path, redis_url, served.url, DRAFTLINE_HOST="0.0.0.0")
    proc.health_url = None
    with proc:
        assert wait_exit(proc) != 0
    log = proc.log()
    assert "DRAFTLINE_HOST=0.0.0.0 is not a loopback address" in log, log
    assert "DRAFTLINE_API_TOKEN" in log and "DRAFTLINE_ALLOW_UNAUTHENTICATED=true" in log, log
    assert "Uvicorn running" not in log


def test_allow_unauthenticated_lets_it_listen_beyond_loopback_and_warns(tmp_path, redis_url, served):
    proc, url = start_controller(tmp_path, redis_url, served.url, DRAFTLINE_HOST="0.0.0.0",
                                 DRAFTLINE_ALLOW_UNAUTHENTICATED="true")
    with proc:  # healthy on 127.0.0.1, which 0.0.0.0 includes
        assert httpx.get(f"{url}/runs", timeout=30).status_code == 200
    assert "without DRAFTLINE_API_TOKEN" in proc.full_log()  # a start-up line: the log's tail may not hold it


def test_a_token_lets_it_listen_beyond_loopback(tmp_path, redis_url, served):
    proc, url = start_controller(tmp_path, redis_url, served.url, DRAFTLINE_HOST="0.0.0.0", DRAFTLINE_API_TOKEN=TOKEN)
    with proc:
        assert httpx.post(f"{url}/runs", json={}, timeout=30).status_code == 401


@pytest.mark.parametrize("token", ["short", " " + TOKEN])
def test_a_weak_token_stops_the_controller_naming_the_setting(tmp_path, redis_url, served, token):
    proc, _ = start_controller(tmp_path, redis_url, served.url, DRAFTLINE_API_TOKEN=token)
    proc.health_url = None
    with proc:
        assert wait_exit(proc) != 0
    log = proc.log()
    assert "DRAFTLINE_API_TOKEN: Value error, use at least 16 characters" in log, log
    assert token.strip() not in log  # the refused value is not echoed into the log
