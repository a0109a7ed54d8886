"""The controller's HTTP API, served by a real ``draftline serve controller`` process."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import redis

from shared.jobs import GENERATE_QUEUE
from runtime.queues import queue
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.support.openai_server import OpenAIServer
from tests.support.processes import ServiceProcess, free_port


def controller_env(data, redis_url: str, port: int, inference_url: str) -> dict[str, str]:
    return {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data), "DRAFTLINE_PORT": str(port), "DRAFTLINE_HOST": "127.0.0.1",
            "DRAFTLINE_FEED_INTERVAL_S": "0.1", "DRAFTLINE_GENERATE_BATCH": "4", "DRAFTLINE_FEED_WINDOW": "2",
            "DRAFTLINE_INFERENCE_URL": inference_url,
            # Tests write their datasets beside the volume.
            "DRAFTLINE_DATASET_ROOTS": str(data.parent),
            # Test volumes live under /tmp: preflight would refuse them as ephemeral without this.
            "DRAFTLINE_ALLOW_EPHEMERAL_DATA": "true",
            # Tests never reach the Hub: an empty cache, offline, so a repo id fails fast and by name.
            "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(data.parent / "hf-cache")}


@pytest.fixture(scope="module")
def api(tmp_path_factory, redis_server):
    root = tmp_path_factory.mktemp("api")
    data = root / "data"
    data.mkdir()
    redis.Redis.from_url(redis_server.url).flushall()
    port = free_port()
    with OpenAIServer(model="served-name") as target:
        env = controller_env(data, redis_server.url, port, target.url)
        with ServiceProcess("controller", env=env, log_dir=root / "logs", health_url=f"http://127.0.0.1:{port}/health"):
            yield {"url": f"http://127.0.0.1:{port}", "data": data, "root": root,
                   "conn": redis.Redis.from_url(redis_server.url)}


def dataset(api, name: str, rows: int = 12, bad: tuple[int, ...] = ()) -> str:
    lines = ["{broken" if i in bad else {"prompt": f"{name} {i}"} for i in range(rows)]
    return str(write_jsonl(api["root"] / f"{name}.jsonl", lines))


def post(api, body: object, **kwargs) -> httpx.Response:
    return httpx.post(f"{api['url']}/runs", json=body, timeout=30, **kwargs)


def test_health(api):
    response = httpx.get(f"{api['url']}/health", timeout=5)
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "redis": True}


def test_submit_returns_the_run_spec_and_the_supervisor_feeds_it(api):
    body = {"dataset": dataset(api, "one", bad=(3,)), "name": "one", "model": "served-name",
            "generation": {"max_tokens": 7}, "evaluate": {"holdout": 2}}
    response = post(api, body)
    assert response.status_code == 201, response.text
    spec = response.json()
    assert (spec["name"], spec["rows"], spec["train_ids"], spec["generation"]["max_tokens"]) == ("one", 12, 10, 7)
    deadline = time.monotonic() + 20
    while queue(GENERATE_QUEUE, api["conn"]).count < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert queue(GENERATE_QUEUE, api["conn"]).count == 2  # the window, filled by the background loop
    status = httpx.get(f"{api['url']}/runs/one", timeout=10).json()
    assert (status["run"], status["state"], status["expected"]) == ("one", "generating", 10)
    assert status["failures"][0]["sample_id"] == 3 and status["failures"][0]["error_class"] == "InvalidJson"
    listed = httpx.get(f"{api['url']}/runs", timeout=10).json()
    assert "one" in [s["run"] for s in listed]
    failures = httpx.get(f"{api['url']}/runs/one/failures", params={"stage": "generate"}, timeout=10).json()
    assert failures["total"] == 1 and failures["failures"][0]["error_class"] == "InvalidJson"


def test_run_without_model_asks_the_inference_server(api):
    response = post(api, {"dataset": dataset(api, "nomodel"), "name": "nomodel", "evaluate": {"holdout": 1}})
    assert response.status_code == 201, response.text
    assert response.json()["model"] == "served-name"


def test_relative_dataset_path_is_read_from_the_volume(api):
    write_jsonl(api["data"] / "on-volume.jsonl", [{"prompt": f"v{i}"} for i in range(4)])
    response = post(api, {"dataset": "on-volume.jsonl", "name": "relative", "model": "served-name", "evaluate": {"holdout": 1}})
    assert response.status_code == 201, response.text
    assert response.json()["dataset"] == str(api["data"] / "on-volume.jsonl")


def test_existing_run_is_409(api):
    body = {"dataset": dataset(api, "twice"), "name": "twice", "model": "served-name", "evaluate": {"holdout": 1}}
    assert post(api, body).status_code == 201
    response = post(api, body)
    assert response.status_code == 409
    assert "already exists" in response.json()["detail"]


@pytest.mark.parametrize(("dataset", "words"), [
    (lambda api: str(api["root"] / "nowhere" / "rows.jsonl"), "no such file or directory"),
    (lambda api: "owner/not-cached-here", "cannot be fetched"),  # a repo id still goes to the Hub
])
def test_unreadable_dataset_is_400(api, dataset, words):
    response = post(api, {"dataset": dataset(api), "name": "missing", "model": "served-name"})
    assert response.status_code == 400
    assert words in response.json()["detail"]


def outside_roots(api, tmp_path) -> list[str]:
    """Datasets that lie outside the controller's one dataset root (api["root"]), each by another way."""
    elsewhere = write_jsonl(tmp_path / "elsewhere.jsonl", [{"prompt": "a secret"}, {"prompt": "another"}])
    link = api["root"] / "link-out.jsonl"
    link.unlink(missing_ok=True)
    link.symlink_to(elsewhere)
    folder = api["root"] / "folder-with-a-link"
    folder.mkdir(exist_ok=True)
    (folder / "train.jsonl").unlink(missing_ok=True)
    (folder / "train.jsonl").symlink_to(elsewhere)
    return [str(elsewhere), os.path.relpath(elsewhere, api["data"]), str(api["root"] / ".." / elsewhere.name),
            str(link), str(folder), "/etc/passwd", "/nowhere/rows.jsonl"]


def test_a_dataset_outside_the_dataset_roots_is_403_naming_them(api, tmp_path):
    for dataset in outside_roots(api, tmp_path):
        response = post(api, {"dataset": dataset, "name": "outside", "model": "served-name", "evaluate": {"holdout": 1}})
        assert response.status_code == 403, (dataset, response.text)
        detail = response.json()["detail"]
        assert "outside the dataset roots" in detail and str(api["root"]) in detail, detail
        assert "DRAFTLINE_DATASET_ROOTS" in detail
    assert not (api["data"] / "runs" / "outside").exists()


def test_dataset_without_valid_rows_is_400(api):
    response = post(api, {"dataset": dataset(api, "allbad", rows=3, bad=(0, 1, 2)), "name": "allbad", "model": "served-name"})
    assert response.status_code == 400
    assert "no valid rows" in response.json()["detail"]


@pytest.mark.parametrize("body", [
    {},
    {"name": "x", "model": "served-name"},
    {"dataset": "d.jsonl", "model": "served-name", "unknown": 1},
    {"dataset": "d.jsonl", "model": "served-name", "name": "../escape"},
    {"dataset": "d.jsonl", "model": "served-name", "name": ""},
    {"dataset": "d.jsonl", "model": "served-name", "limit": 0},
    {"dataset": "d.jsonl", "model": "served-name", "limit": "many"},
    {"dataset": "d.jsonl", "model": "served-name", "generation": {"max_tokens": 0}},
    {"dataset": "d.jsonl", "model": "served-name", "train": {"epochs": "two"}},
    {"dataset": "d.jsonl", "model": "served-name", "evaluate": {"holdout": -1, "x": 1}},
    {"dataset": 5, "model": "served-name"},
    ["dataset", "d.jsonl"],
    "just a string",
])
def test_bad_bodies_are_422(api, body):
    response = post(api, body)
    assert response.status_code == 422, response.text


def test_non_json_body_is_422(api):
    response = httpx.post(f"{api['url']}/runs", content=b"{not json", headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 422


def test_unknown_run_is_404(api):
    assert httpx.get(f"{api['url']}/runs/nope", timeout=10).status_code == 404
    assert httpx.get(f"{api['url']}/runs/nope/failures", timeout=10).status_code == 404
    assert httpx.get(f"{api['url']}/runs/bad..name", timeout=10).status_code == 404


def test_unreachable_inference_server_is_503_and_sigterm_stops_cleanly(tmp_path, redis_server):
    port, dead = free_port(), free_port()
    data = tmp_path / "data"
    env = controller_env(data, redis_server.url, port, f"http://127.0.0.1:{dead}")
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    proc = ServiceProcess("controller", env=env, log_dir=tmp_path / "logs", health_url=f"http://127.0.0.1:{port}/health")
    with proc:
        response = httpx.post(f"http://127.0.0.1:{port}/runs", json={"dataset": str(tmp_path / "d.jsonl"), "name": "x",
                                                                     "evaluate": {"holdout": 1}}, timeout=30)
        assert response.status_code == 503
        assert "does not say which one it serves" in response.json()["detail"]
        proc.stop(signal.SIGTERM)
        # uvicorn re-raises the signal after its graceful shutdown, so the exit status says SIGTERM.
        assert proc.proc.returncode in (0, -signal.SIGTERM)
    log = proc.log()
    assert log.index("supervisor: stopped") < log.index("Application shutdown complete")


def test_a_repo_id_that_names_a_local_path_is_checked_as_that_path(tmp_path, monkeypatch):
    # Reading a run's dataset looks for a local path of that name first, so the check must too.
    from services.controller.runs.start import DatasetOutsideRoots, resolve_dataset

    data, roots = tmp_path / "data", (tmp_path / "data" / "datasets",)
    (tmp_path / "owner" / "name").mkdir(parents=True)
    write_jsonl(tmp_path / "owner" / "name" / "train.jsonl", [{"prompt": "from the working directory"}])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetOutsideRoots, match="outside the dataset roots"):
        resolve_dataset("owner/name", data, roots)
    assert resolve_dataset("owner/other", data, roots) == "owner/other"  # no local path: the Hub's
    (roots[0] / "owner" / "name").mkdir(parents=True)
    write_jsonl(roots[0] / "owner" / "name" / "train.jsonl", [{"prompt": "on the volume"}])
    assert resolve_dataset("datasets/owner/name", data, roots) == str((roots[0] / "owner" / "name").resolve())


def test_retrain_lays_a_run_from_a_finished_capture_and_refuses_what_it_cannot(api):
    from services.cli.api import ControllerClient, ControllerRefused
    from services.controller.loop.reconcile import reconcile_run
    from runtime.runstate import RunState
    from shared.runspec import RunSpec
    from tests.services.controller.volume import finish_samples, prompt_rows, submit

    data, conn = api["data"], api["conn"]
    state = submit(data, conn, api["root"], "captured", prompt_rows(6), holdout=1)
    finish_samples(state, generated=range(5), extracted=range(5))
    reconcile_run(data, conn, "captured")
    deadline = time.monotonic() + 30
    while state.meta().get("state") != "training" and time.monotonic() < deadline:  # the live supervisor advances it
        time.sleep(0.1)
    assert state.meta().get("state") == "training"
    url = f"{api['url']}/runs/captured/retrain"
    made = httpx.post(url, json={"name": "captured-lr", "train": {"lr": 1e-3}}, timeout=30)
    assert made.status_code == 201, made.text
    assert made.json()["name"] == "captured-lr" and RunSpec.load(data, "captured-lr").train.lr == 1e-3
    assert RunState(conn, data, "captured-lr").meta()["expected"] == "5"  # registered at once
    for body, status, words in (({"name": "captured-lr"}, 409, "already exists"),
                                ({"name": "x", "generation": {"max_tokens": 9}}, 422, "generation"),
                                ({"name": "x", "extraction": {}}, 422, "extraction"),
                                ({"name": "x", "evaluate": {"holdout": 3}}, 409, "evaluate.holdout"),
                                ({"name": "x", "train": {"lr": -1}}, 422, "lr"),
                                ({"name": "../x"}, 422, "invalid run name")):
        refused = httpx.post(url, json=body, timeout=30)
        assert refused.status_code == status and words in refused.text, (body, refused.text)
    assert httpx.post(f"{api['url']}/runs/nothing/retrain", json={"name": "y"}, timeout=30).status_code == 404
    with ControllerClient(api["url"]) as client:  # what `draftline retrain --controller URL` sends
        made = client.retrain("captured", {"name": "captured-ttt5", "train": {"ttt_steps": 5}})
        assert made["train"]["ttt_steps"] == 5
        with pytest.raises(ControllerRefused, match="409"):
            client.retrain("captured", {"name": "captured-ttt5"})
    from tests.services.cli.test_resume_failures_retry import draftline

    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:1/0", "DRAFTLINE_DATA": str(api["root"] / "elsewhere")}
    done = draftline(env, "retrain", "captured", "--name", "captured-3ep", "--epochs", "3", "--controller", api["url"])
    assert done.returncode == 0, done.stderr  # through the API alone: this shell's Redis and volume are not the stack's
    assert "run captured-3ep: laid from captured's capture" in done.stdout
    assert RunSpec.load(data, "captured-3ep").train.epochs == 3
