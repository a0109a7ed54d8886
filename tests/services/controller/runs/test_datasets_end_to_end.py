"""Bad rows through the real services: controller (reads and feeds), inference server (the tiny target,
4,096-token context), generator and extractor workers.

Each bad row ends as one named failure of its own; rows that look like paths or shell commands are
ordinary prompts that get replies and hidden states, and nothing they spell is run; the good rows go on.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from shared.layout import RunPaths
from tests.services.controller.api.test_api import controller_env
from tests.support.processes import REPO, ServiceProcess, free_port

RUN = "hostile"
LONG_PROMPT = "hello " * 1000  # ~6 KB (far under the byte limit), more tokens than the target's 4,096-token context
MEDIUM_PROMPT = "hello " * 30  # fits the context, not the run's extraction max_length


def hostile_rows(sentinel) -> list[tuple[str, bytes]]:
    """``(expected outcome, JSONL line)``: "ok" rows must be generated and extracted."""
    rows = [
        ("ok", {"prompt": "What is two plus two?"}),
        ("ok", {"prompt": "../../etc/passwd"}),
        ("ok", {"prompt": f"$(touch {sentinel})"}),
        ("ok", {"prompt": "; ls"}),
        ("ok", {"messages": [{"role": "system", "content": f"`touch {sentinel}`"},
                             {"role": "user", "content": "| cat /etc/shadow && echo $HOME"}]}),
        ("ok", {"id": "q1", "prompt": "The first row with id q1 keeps it."}),
        ("DuplicateRow", {"id": "q1", "prompt": "A second row with id q1."}),
        ("EmptyRow", {}),
        ("WrongType", {"prompt": 42}),
        ("InvalidUtf8", b'{"prompt": "caf\xe9"}'),
        ("MissingField", {"text": "no known field"}),
        ("PromptTooLong", {"prompt": "x" * (1 << 20)}),  # 1 MB: refused when the dataset is read
        ("context", {"prompt": LONG_PROMPT}),  # refused by the target at generation
        ("PromptTooLong", {"prompt": MEDIUM_PROMPT}),  # refused at extraction (max_length below)
        ("ok", {"prompt": "Name three colours."}),
        ("ok", {"conversations": [{"from": "human", "value": "Say hi."}]}),
        ("held-out", {"prompt": "Explain rain in one line."}),
    ]
    return [(kind, row if isinstance(row, bytes) else json.dumps(row).encode()) for kind, row in rows]


def wait_settled(url: str, services: list[ServiceProcess], timeout: float = 300.0) -> dict:
    """The run's status once every expected sample has settled in both stages."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for service in services:
            assert service.alive(), f"{service.name} exited:\n{service.log()}"
        status = httpx.get(f"{url}/runs/{RUN}", timeout=30).json()
        gen, ext = status["stages"]["generate"], status["stages"]["extract"]
        if gen["remaining"] == 0 and ext["remaining"] == 0:
            return status
        time.sleep(0.5)
    raise AssertionError(f"run did not settle: {status}\n" + "\n".join(s.log()[-3000:] for s in services))


@pytest.fixture(scope="module")
def settled(tmp_path_factory, redis_server, tiny_model_dir):
    import redis

    root = tmp_path_factory.mktemp("hostile")
    data, logs = root / "data", root / "logs"
    data.mkdir()
    redis.Redis.from_url(redis_server.url).flushall()
    sentinel = root / "pwned"
    rows = hostile_rows(sentinel)
    dataset = root / "hostile.jsonl"
    dataset.write_bytes(b"\n".join(line for _, line in rows) + b"\n")
    inference_port, controller_port = free_port(), free_port()
    inference_url = f"http://127.0.0.1:{inference_port}"
    common = {"REDIS_URL": redis_server.url, "DRAFTLINE_DATA": str(data), "DRAFTLINE_MODEL_DIR": str(tiny_model_dir),
              "DRAFTLINE_DEVICE": "cpu"}
    inference = ServiceProcess("inference", env={**common, "DRAFTLINE_HOST": "127.0.0.1", "DRAFTLINE_PORT": str(inference_port),
                                                 "DRAFTLINE_BATCH_WAIT_MS": "0"}, log_dir=logs, health_url=inference_url + "/health")
    controller = ServiceProcess("controller", env={**common, **controller_env(data, redis_server.url, controller_port, inference_url)},
                                log_dir=logs, health_url=f"http://127.0.0.1:{controller_port}/health")
    generator = ServiceProcess("generator", env={**common, "DRAFTLINE_INFERENCE_URL": inference_url}, log_dir=logs)
    extractor = ServiceProcess("extractor", env={**common, "DRAFTLINE_HIDDEN_STATES_URL": inference_url}, log_dir=logs)
    services = [inference, controller, generator, extractor]
    try:
        for service in services:
            service.start()
        url = f"http://127.0.0.1:{controller_port}"
        body = {"dataset": str(dataset), "name": RUN, "model": "tiny",
                "generation": {"max_tokens": 4, "min_completion_tokens": 0, "temperature": 0},
                "extraction": {"max_length": 96}, "evaluate": {"holdout": 1}}
        response = httpx.post(f"{url}/runs", json=body, timeout=120)
        assert response.status_code == 201, response.text
        status = wait_settled(url, services)
        failures = httpx.get(f"{url}/runs/{RUN}/failures", timeout=30).json()["failures"]
        yield {"status": status, "failures": {f["sample_id"]: f for f in failures}, "rows": rows,
               "paths": RunPaths(data, RUN), "sentinel": sentinel}
    finally:
        for service in reversed(services):
            service.stop()


def ids_of(rows, kind: str) -> list[int]:
    return [i for i, (k, _) in enumerate(rows) if k == kind]


def test_each_bad_row_is_one_named_failure_and_the_rest_of_the_run_proceeds(settled):
    rows, failures, status = settled["rows"], settled["failures"], settled["status"]
    expected = {i: kind for i, (kind, _) in enumerate(rows) if kind not in ("ok", "held-out")}
    assert set(failures) == set(expected), failures
    for sample_id, kind in expected.items():
        failure = failures[sample_id]
        assert failure["kind"] == "error" and failure["message"], failure
        if kind == "context":
            assert failure["stage"] == "generate" and "4096" in failure["message"] and "context" in failure["message"]
        else:
            assert failure["error_class"] == kind, failure
    assert failures[ids_of(rows, "DuplicateRow")[0]]["message"] == 'id "q1" repeats the id of row 5'
    medium = ids_of(rows, "PromptTooLong")[1]
    assert failures[medium]["stage"] == "extract" and "max_length 96" in failures[medium]["message"]
    ok = ids_of(rows, "ok")
    assert status["stages"]["generate"]["done"] == len(ok) + 1  # + the medium row, which fails only at extraction
    assert status["stages"]["extract"]["done"] == len(ok)
    assert status["expected"] == len(rows) - 1  # the last valid row is held out


def test_path_and_shell_like_rows_are_answered_as_ordinary_prompts_and_nothing_runs(settled):
    rows, paths = settled["rows"], settled["paths"]
    prompts = {json.loads(line)["sample_id"]: json.loads(line)["messages"] for line in paths.prompts.read_text().splitlines()}
    for sample_id in ids_of(rows, "ok"):
        reply = json.loads(paths.generated(sample_id).read_text())
        assert reply["messages"] == prompts[sample_id]  # the text went out exactly as the dataset wrote it
        assert paths.hidden(sample_id).is_file()
    assert prompts[1] == [{"role": "user", "content": "../../etc/passwd"}]
    assert prompts[2] == [{"role": "user", "content": f"$(touch {settled['sentinel']})"}]
    assert not settled["sentinel"].exists() and not (REPO / "pwned").exists()


def test_a_row_past_the_targets_context_fails_as_prompt_too_long(settled):
    failure = settled["failures"][ids_of(settled["rows"], "context")[0]]
    assert failure["error_class"] == "PromptTooLong", failure
