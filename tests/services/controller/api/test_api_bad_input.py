"""Hostile requests to the controller's API get a 4xx that says why, never a 500, and leave nothing behind.

Part one sends hand-written bodies to a real ``draftline serve controller`` process; part two sends
generated bodies (hypothesis) to the same app in-process.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import httpx
import pytest
import redis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.controller.api.app import create_app
from shared.settings import ControllerSettings
from tests.services.controller.api.test_api import controller_env
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.support.openai_server import OpenAIServer
from tests.support.processes import ServiceProcess, free_port

JSON = {"content-type": "application/json"}
GOOD_ROWS = [{"prompt": f"question {i}"} for i in range(6)]


@pytest.fixture(scope="module")
def api(tmp_path_factory, redis_server):
    root = tmp_path_factory.mktemp("api-bad")
    data = root / "data"
    data.mkdir()
    redis.Redis.from_url(redis_server.url).flushall()
    write_jsonl(root / "good.jsonl", GOOD_ROWS)
    port = free_port()
    with OpenAIServer(model="served-name") as target:
        env = controller_env(data, redis_server.url, port, target.url)
        with ServiceProcess("controller", env=env, log_dir=root / "logs", health_url=f"http://127.0.0.1:{port}/health") as proc:
            yield {"url": f"http://127.0.0.1:{port}", "data": data, "root": root, "good": str(root / "good.jsonl"), "proc": proc}


def raw(text: str) -> dict:
    return {"content": text.encode("utf-8", "surrogatepass"), "headers": JSON}


def good(api, **fields) -> dict:
    return {"dataset": api["good"], "model": "served-name", "evaluate": {"holdout": 1}, **fields}


def assert_refused(response: httpx.Response, statuses: range = range(400, 500)) -> None:
    assert response.status_code in statuses, f"{response.status_code}: {response.text[:500]}"
    detail = response.json()["detail"]
    assert detail, response.text
    assert response.headers["content-type"].startswith("application/json")


# Each case: (name, function of the fixture returning httpx.post keyword arguments).
BAD_POSTS = [
    ("invalid-json", lambda a: {"content": b"{not json", "headers": JSON}),
    ("truncated-json", lambda a: {"content": b'{"dataset": "x', "headers": JSON}),
    ("empty-body", lambda a: {"content": b"", "headers": JSON}),
    ("invalid-utf8", lambda a: {"content": b'{"dataset": "\xff\xfe"}', "headers": JSON}),
    ("nested-100k-deep", lambda a: {"content": b'{"dataset": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "headers": JSON}),
    ("5000-digit-number", lambda a: {"content": b'{"dataset": "d", "limit": ' + b"9" * 5000 + b"}", "headers": JSON}),
    ("text-plain", lambda a: {"content": json.dumps(good(a)).encode(), "headers": {"content-type": "text/plain"}}),
    ("form-encoded", lambda a: {"data": {"dataset": a["good"], "model": "served-name"}}),
    ("multipart", lambda a: {"files": {"dataset": ("d.jsonl", b'{"prompt": "x"}\n')}}),
    ("json-array", lambda a: {"json": [good(a)]}),
    ("json-null", lambda a: {"json": None}),
    ("dataset-list", lambda a: {"json": {**good(a), "dataset": [a["good"]]}}),
    ("dataset-object", lambda a: {"json": {**good(a), "dataset": {"path": a["good"]}}}),
    ("dataset-bool", lambda a: {"json": {**good(a), "dataset": True}}),
    ("dataset-empty", lambda a: {"json": {**good(a), "dataset": ""}}),
    ("dataset-missing-file", lambda a: {"json": {**good(a), "dataset": "/nowhere/rows.jsonl", "name": "missing"}}),
    ("dataset-etc-passwd", lambda a: {"json": {**good(a), "dataset": "../../../../../../etc/passwd", "name": "passwd"}}),
    ("dataset-volume-root", lambda a: {"json": {**good(a), "dataset": ".", "name": "volroot"}}),
    ("dataset-filesystem-root", lambda a: {"json": {**good(a), "dataset": "/", "name": "fsroot"}}),
    ("dataset-nul", lambda a: {"json": {**good(a), "dataset": "rows\x00.jsonl", "name": "nul"}}),
    ("dataset-shell", lambda a: {"json": {**good(a), "dataset": "$(touch /tmp/draftline-pwned).jsonl", "name": "shell"}}),
    ("dataset-not-cached-hub-id", lambda a: {"json": {**good(a), "dataset": "owner/not-cached", "name": "hub"}}),
    ("dataset-300-chars", lambda a: {"json": {**good(a), "dataset": "d" * 300}}),
    ("dataset-20-MB", lambda a: {"json": {**good(a), "dataset": "x" * (20 << 20)}}),
    ("name-dotdot-slash", lambda a: {"json": good(a, name="../escape")}),
    ("name-dotdot", lambda a: {"json": good(a, name="..")}),
    ("name-absolute", lambda a: {"json": good(a, name="/etc/cron.d/x")}),
    ("name-slash", lambda a: {"json": good(a, name="a/b")}),
    ("name-backslash", lambda a: {"json": good(a, name="a\\..\\b")}),
    ("name-percent-encoded", lambda a: {"json": good(a, name="%2e%2e%2fx")}),
    ("name-101-chars", lambda a: {"json": good(a, name="n" * 101)}),
    ("name-unicode", lambda a: {"json": good(a, name="naïve")}),
    ("name-space", lambda a: {"json": good(a, name="a b")}),
    ("name-shell", lambda a: {"json": good(a, name="$(id)")}),
    ("name-int", lambda a: {"json": good(a, name=5)}),
    ("unknown-field", lambda a: {"json": good(a, name="unknown", colour="blue")}),
    ("unknown-nested-field", lambda a: {"json": good(a, name="unknown2", train={"epochs": 1, "colour": "blue"})}),
    ("limit-string", lambda a: {"json": good(a, limit="ten")}),
    ("limit-zero", lambda a: {"json": good(a, limit=0)}),
    ("limit-fraction", lambda a: {"json": good(a, limit=1.5)}),
    ("split-list", lambda a: {"json": good(a, split=["train"])}),
    ("model-object", lambda a: {"json": good(a, model={"id": "m"})}),
    ("model-not-served", lambda a: {"json": good(a, name="other-model", model="not-served")}),
    ("generation-string", lambda a: {"json": good(a, generation="fast")}),
    ("generation-negative", lambda a: {"json": good(a, generation={"max_tokens": -5})}),
    ("temperature-string", lambda a: {"json": good(a, generation={"temperature": "hot"})}),
    ("top-p-above-one", lambda a: {"json": good(a, generation={"top_p": 1.5})}),
    ("layer-ids-string", lambda a: {"json": good(a, extraction={"layer_ids": "1,2,3"})}),
    ("train-list", lambda a: {"json": good(a, train=[1, 2])}),
    ("epochs-nested-garbage", lambda a: {"json": good(a, train={"epochs": {"a": [None, {"b": []}]}})}),
    ("holdout-more-than-rows", lambda a: {"json": good(a, name="holdall", evaluate={"holdout": 10**30})}),
    ("base-checkpoint-outside-volume", lambda a: {"json": good(a, name="basex", train={"base_checkpoint": "../../etc"})}),
    ("force-object", lambda a: {"json": good(a, force={"yes": True})}),
    ("temperature-nan", lambda a: raw('{"dataset": "d.jsonl", "model": "m", "generation": {"temperature": NaN}}')),
    ("limit-infinity", lambda a: raw('{"dataset": "d.jsonl", "model": "m", "limit": Infinity}')),
    ("lr-infinity", lambda a: raw(json.dumps(good(a, name="lrinf"))[:-1] + ', "train": {"lr": Infinity}}')),
    ("seed-10e30", lambda a: {"json": good(a, name="bigseed", generation={"seed": 10**30})}),
    ("dataset-lone-surrogate", lambda a: raw('{"dataset": "\\ud800.jsonl", "model": "m"}')),
    ("name-lone-surrogate", lambda a: raw('{"dataset": "d.jsonl", "model": "m", "name": "\\udfff"}')),
    ("base-checkpoint-nul", lambda a: {"json": good(a, name="basenul", train={"base_checkpoint": "a\x00b"})}),
    ("base-checkpoint-300-chars", lambda a: {"json": good(a, name="baselong", train={"base_checkpoint": "b" * 300})}),
]


@pytest.mark.parametrize(("case", "request_for"), BAD_POSTS, ids=[c.values[0] if hasattr(c, "values") else c[0] for c in BAD_POSTS])
def test_a_bad_submission_is_a_4xx_with_a_message(api, case, request_for):
    response = httpx.post(f"{api['url']}/runs", timeout=60, **request_for(api))
    assert_refused(response)


def test_a_body_over_the_size_limit_is_a_413(api):
    from services.controller.api.app import MAX_REQUEST_BYTES

    body = json.dumps(good(api, name="huge", padding="x" * MAX_REQUEST_BYTES)).encode()
    assert_refused(httpx.post(f"{api['url']}/runs", content=body, headers=JSON, timeout=60), range(413, 414))
    streamed = httpx.post(f"{api['url']}/runs", content=iter([body[:1 << 19], body[1 << 19:]]), headers=JSON, timeout=60)
    assert_refused(streamed, range(413, 414))


BAD_GETS = ["/runs/..", "/runs/../runs/..", "/runs/../../etc/passwd", "/runs/%2e%2e", "/runs/%2e%2e%2f%2e%2e%2fetc%2fpasswd", "/runs/a%2Fb", "/runs/%00", "/runs/%ff",
            "/runs/%ED%A0%80", "/runs/" + "r" * 5000, "/runs/na%C3%AFve", "/runs/$(id)", "/runs/;ls", "/runs/<script>",
            "/runs/nope/failures", "/runs/..%2f..%2fetc/failures", "/runs/x/failures?stage=../../etc",
            "/runs/x/failures?offset=-1", "/runs/x/failures?limit=0", "/runs/x/failures?limit=abc",
            "/runs/x/failures?offset=" + "9" * 400]


def get_verbatim(url: str, path: str) -> httpx.Response:
    """GET ``path`` exactly as written: HTTP clients drop ``..`` segments before sending, an attacker does not."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        return httpx.Response(answer.status, headers=answer.getheaders(), content=answer.read())
    finally:
        conn.close()


@pytest.mark.parametrize("path", BAD_GETS, ids=range(len(BAD_GETS)))
def test_a_weird_run_name_in_the_path_is_a_4xx(api, path):
    assert_refused(get_verbatim(api["url"], path))


def test_after_the_hostile_requests_the_api_still_works_and_nothing_was_left_behind(api, tmp_path):
    # Module order runs this after the cases above; it also holds alone.
    assert api["proc"].alive()
    assert httpx.get(f"{api['url']}/health", timeout=10).json()["status"] == "ok"
    response = httpx.post(f"{api['url']}/runs", json=good(api, name="still-fine"), timeout=60)
    assert response.status_code == 201, response.text
    runs = {p.name for p in (api["data"] / "runs").iterdir()}
    refused = {"missing", "passwd", "volroot", "fsroot", "nul", "shell", "hub", "unknown", "unknown2", "other-model",
               "holdall", "basex", "escape"}
    assert not runs & refused, runs & refused  # a refused submission leaves no run directory
    assert not (api["data"].parent / "escape").exists() and not (api["data"] / "escape").exists()
    assert not list(api["data"].rglob(".tmp-*"))


# ---- generated bodies against the app in-process ---------------------------------------------

# Anything a JSON body can hold, NaN, Infinity and lone surrogates (sent as \ud800 escapes) included.
SURROGATE_TEXT = st.builds("{}{}".format, st.text(max_size=8), st.characters(categories=["Cs"]))
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30) | SURROGATE_TEXT
ANY_JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                        max_leaves=8)
CONFIG_KEYS = st.sampled_from(["max_tokens", "min_completion_tokens", "temperature", "top_p", "seed", "layer_ids", "max_length",
                               "epochs", "batch_size", "lr", "warmup_ratio", "grad_clip", "ttt_steps", "draft_vocab_size",
                               "save_every", "base_checkpoint", "holdout", "max_new_tokens", "draft_steps", "colour"])
SECTION = st.dictionaries(CONFIG_KEYS, SCALARS | st.lists(st.integers(), max_size=4), max_size=4) | ANY_JSON
ALLOWED = {201, 400, 403, 404, 409, 412, 413, 422}


def bodies(good_path: str):
    return st.fixed_dictionaries({}, optional={
        "dataset": st.sampled_from([good_path, "nowhere.jsonl", "owner/repo", "", ".", "../.."]) | st.text(max_size=40) | ANY_JSON,
        "name": st.text(alphabet="ab.-_/\\%0 ", max_size=12) | ANY_JSON,
        "limit": SCALARS, "model": st.sampled_from(["served-name", "other"]) | SCALARS,
        "split": st.sampled_from(["train", "test"]) | SCALARS,
        "generation": SECTION, "extraction": SECTION, "train": SECTION, "evaluate": SECTION,
        "force": SCALARS, "colour": SCALARS,
    }) | ANY_JSON


def test_generated_bodies_never_get_a_500(redis_url, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTLINE_ALLOW_EPHEMERAL_DATA", "true")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    data = tmp_path / "data"
    data.mkdir()
    good_path = str(write_jsonl(tmp_path / "good.jsonl", GOOD_ROWS))
    seen: dict[int, int] = {}
    with OpenAIServer(model="served-name") as target:
        app = create_app(ControllerSettings(data=data, redis_url=redis_url, inference_url=target.url,
                                            dataset_roots=str(tmp_path)),
                         redis.Redis.from_url(redis_url))
        with TestClient(app, raise_server_exceptions=False) as client:

            @settings(max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
            @given(bodies(good_path))
            def post(body):
                response = client.post("/runs", content=json.dumps(body).encode(), headers=JSON)  # \uXXXX escapes, NaN as NaN
                seen[response.status_code] = seen.get(response.status_code, 0) + 1
                assert response.status_code in ALLOWED, (body, response.status_code, response.text[:300])
                if response.status_code != 201:
                    assert response.json()["detail"]

            post()
    assert seen.get(422, 0) > 0 and sum(seen.values()) == 150, seen
