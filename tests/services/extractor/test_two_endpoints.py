"""A real extractor worker pointed at two real inference servers uses both, and finishes the run when one
of them is SIGKILLed mid-run."""

from __future__ import annotations

import signal

import pytest

from services.controller.runs.submit import submit_run
from shared import SCHEMA_VERSION
from shared.atomic import atomic_write_json
from shared.runspec import EvalConfig, RunSpec
from runtime.runstate import RunState
from runtime.sample_queue import enqueue_extract
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.services.generator.inference_pair import (
    HIDDEN_ENDPOINT,
    inference_pair,
    served,
    untaught_tiny,
    wait_until,
)
from tests.support.processes import ServiceProcess

RUN = "two-endpoints"
SAMPLES = 10
FIRST = 4  # extracted while both servers live


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return untaught_tiny(tmp_path_factory.mktemp("models"))


def make_run(data_dir, conn, tmp_path) -> RunState:
    """A submitted run whose every sample already has its reply on the volume."""
    prompts = [f"question {i}" for i in range(SAMPLES)] + ["held out"]
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": p} for p in prompts])
    submit_run(data_dir, conn, RunSpec(dataset=str(dataset), name=RUN, model="tiny", evaluate=EvalConfig(holdout=1)))
    state = RunState(conn, data_dir, RUN)
    for sample_id in range(SAMPLES):
        atomic_write_json(state.paths.generated(sample_id), {
            "schema_version": SCHEMA_VERSION, "sample_id": sample_id,
            "messages": [{"role": "user", "content": prompts[sample_id]}],
            "reply": {"content": f"answer number {sample_id}", "reasoning_content": None},
            "usage": {"completion_tokens": 3}, "finish_reason": "stop", "model": "tiny",
        })
        state.mark_done("generate", sample_id)
    return state


def test_a_worker_uses_both_endpoints_and_finishes_every_sample_after_one_is_killed(
        model_dir, data_dir, redis_url, redis_conn, tmp_path):
    state = make_run(data_dir, redis_conn, tmp_path)

    def extracted() -> int:
        counts = state.counts("extract")
        return counts.done + counts.failed

    # Both servers write onto the run's volume: the worker names the path, whichever server answers.
    with inference_pair(model_dir, data_dir, tmp_path / "logs") as [(a, a_url), (_, b_url)]:
        # One attempt per request: a sample that succeeds after the kill got there by failing over.
        env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_MODEL_DIR": str(model_dir),
               "DRAFTLINE_HIDDEN_STATES_URL": f"{a_url}, {b_url}", "DRAFTLINE_RETRY_MAX_ATTEMPTS": "1"}
        with ServiceProcess("extractor", env=env, log_dir=tmp_path / "logs") as worker:
            for sample_id in range(FIRST):
                enqueue_extract(redis_conn, RUN, [sample_id], batch=1)
            wait_until(lambda: extracted() == FIRST, "the first samples extracted", 180, worker)
            # Each job (of one sample here) starts at the endpoint its first sample id names: even ids at a, odd at b.
            assert served(a_url, HIDDEN_ENDPOINT) == FIRST // 2 and served(b_url, HIDDEN_ENDPOINT) == FIRST // 2
            assert float(state.meta().get("extract_retried", 0)) == 0

            a.stop(signal.SIGKILL)
            for sample_id in range(FIRST, SAMPLES):
                enqueue_extract(redis_conn, RUN, [sample_id], batch=1)
            wait_until(lambda: extracted() == SAMPLES, "every sample extracted with one endpoint dead", 300, worker)
        counts = state.counts("extract")
        assert (counts.done, counts.failed) == (SAMPLES, 0), state.failures()
        assert served(b_url, HIDDEN_ENDPOINT) == FIRST // 2 + SAMPLES - FIRST  # the rest went to the survivor
    for sample_id in range(SAMPLES):
        assert state.paths.hidden(sample_id).is_file()
    # The even samples after the kill asked the dead endpoint first and failed over: one retry each.
    assert float(state.meta()["extract_retried"]) == (SAMPLES - FIRST) // 2
