"""Losing Redis mid-run loses no work.

Real processes: the built-in inference server on the tiny target, the controller (its supervisor),
generator, extractor and trainer workers, and a scripted OpenAI-compatible server for the replies. Redis
is flushed while samples are being extracted, and two finished hidden-state files are damaged; the
controller notices the run is gone, rebuilds it from the volume by itself (redoing the damaged files),
and the run completes with every sample verified exactly once.
"""

from __future__ import annotations

import time

import httpx
import pytest

from runtime.runstate import RunState, bitmap_ids, read_finished
from shared.lifecycle import Outcome, RunKeys, Stage
from services.controller.runs.status import run_status
from shared.atomic import temp_files
from shared.hidden_file import verify_hidden_file
from shared.manifest import MANIFEST_NAME, read_manifest
from shared.runspec import EvalConfig, GenerationConfig, TrainConfig
from tests.services.controller.volume import prompt_rows, submit
from tests.support.openai_server import OpenAIServer, Reply
from tests.support.processes import ServiceProcess, free_port

RUN = "flushed"
ROWS, BAD = 41, (7, 23)  # ids 0..39 expected (40 held out); two malformed rows


def wait_for(condition, procs: list[ServiceProcess], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for proc in procs:
            assert proc.alive(), f"{proc.name} died:\n{proc.log()}"
        if time.monotonic() > deadline:
            logs = "\n\n".join(f"--- {p.name}\n{p.log()[-3000:]}" for p in procs)
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.1)


@pytest.fixture()
def stack(data_dir, redis_url, tiny_model_dir, tmp_path):
    logs = tmp_path / "logs"
    inference_port, controller_port = free_port(), free_port()
    common = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_MODEL_DIR": str(tiny_model_dir),
              "DRAFTLINE_DEVICE": "cpu", "DRAFTLINE_HOST": "127.0.0.1"}
    with OpenAIServer() as chat:
        chat.set_default(Reply("The answer is short and plain, as the stand-in target likes it.", delay_s=0.05))
        procs = [
            ServiceProcess("inference", {**common, "DRAFTLINE_PORT": str(inference_port)}, logs,
                           health_url=f"http://127.0.0.1:{inference_port}/health"),
            ServiceProcess("controller", {**common, "DRAFTLINE_PORT": str(controller_port),
                                          "DRAFTLINE_FEED_INTERVAL_S": "0.2", "DRAFTLINE_GENERATE_BATCH": "4",
                                          "DRAFTLINE_FEED_WINDOW": "2", "DRAFTLINE_INFERENCE_URL": chat.url},
                           logs, health_url=f"http://127.0.0.1:{controller_port}/health"),
            ServiceProcess("generator", {**common, "DRAFTLINE_INFERENCE_URL": chat.url}, logs),
            ServiceProcess("extractor", {**common, "DRAFTLINE_HIDDEN_STATES_URL": f"http://127.0.0.1:{inference_port}"}, logs),
            ServiceProcess("trainer", common, logs),
        ]
        try:
            for proc in procs:
                proc.start()
            yield {"procs": procs, "controller": f"http://127.0.0.1:{controller_port}"}
        finally:
            for proc in reversed(procs):
                proc.stop()


def test_a_flushed_redis_is_rebuilt_by_the_controller_and_the_run_completes(data_dir, redis_conn, tmp_path, stack):
    procs = stack["procs"]
    state = submit(data_dir, redis_conn, tmp_path, RUN, prompt_rows(ROWS, bad=BAD),
                   generation=GenerationConfig(max_tokens=32, min_completion_tokens=1),
                   train=TrainConfig(epochs=1, batch_size=8, ttt_steps=2, draft_vocab_size=64, max_length=64),
                   evaluate=EvalConfig(holdout=1, max_new_tokens=8, draft_steps=2, sets=["holdout"],
                                       curve_max_steps=2))
    wait_for(lambda: state.counts("extract").done >= 4, procs, 120, "the first extractions")
    truncated, unreadable = (state.paths.hidden(i) for i in bitmap_ids(redis_conn.get(RunKeys(RUN).outcome(Stage.EXTRACT, Outcome.DONE)))[:2])
    # The crash that loses Redis also damages two finished files; the rebuild must notice and redo them.
    truncated.write_bytes(truncated.read_bytes()[:-5])
    raw = unreadable.read_bytes()
    unreadable.write_bytes(raw[:8] + b"\x00" + raw[9:])
    redis_conn.flushall()
    assert len(list(state.paths.hidden_dir.rglob("*.safetensors"))) < 38, "the run ended before Redis was lost"

    def finished() -> bool:
        return read_finished(state.paths) is not None

    wait_for(finished, procs, 240, "the run to finish")
    controller_log = next(p for p in procs if p.name == "controller").log()
    assert "lost by Redis; rebuilding" in controller_log and " 2 redone" in controller_log

    status = httpx.get(f"{stack['controller']}/runs/{RUN}", timeout=30).json()
    assert status["state"] == "complete_with_failures" == read_finished(state.paths)["state"]
    assert {f["sample_id"] for f in status["failures"]} == set(BAD), status["failures"]  # restored from the volume
    expected = [i for i in range(ROWS - 1) if i not in BAD]
    files = sorted(state.paths.hidden_dir.rglob("*.safetensors"))
    assert [int(p.stem) for p in files] == expected  # every sample exactly once
    manifest = read_manifest(files[0].parent / MANIFEST_NAME)
    for path in files:
        entry = manifest[int(path.stem)]
        assert verify_hidden_file(path, layer_ids=entry.layer_ids, sha256=entry.sha256).num_tokens == entry.num_tokens
    extract, generate = status["stages"]["extract"], status["stages"]["generate"]
    assert extract["done"] == generate["done"] == len(expected) and generate["failed"] == len(BAD)
    assert sorted(int(p.stem) for p in state.paths.generated_dir.rglob("*.json")) == expected
    assert temp_files(state.paths.root) == []
    assert status["stages"]["evaluate"]["state"] == "done" and state.paths.eval_report.is_file()
    assert run_status(data_dir, redis_conn, RUN)["expected"] == len(expected) + len(BAD)
    assert RunState(redis_conn, data_dir, RUN).meta()["resumed_at"]
