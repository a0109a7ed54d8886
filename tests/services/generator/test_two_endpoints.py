"""A real generator worker pointed at two real inference servers uses both, and finishes the run when one
of them is SIGKILLed mid-run."""

from __future__ import annotations

import signal
from dataclasses import astuple

import pytest

from services.controller.loop.feeder import feed_run
from services.controller.runs.submit import submit_run
from shared.runspec import EvalConfig, GenerationConfig, RunSpec
from runtime.runstate import RunState
from shared.settings import ControllerSettings
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.services.generator.inference_pair import (
    CHAT_ENDPOINT,
    inference_pair,
    served,
    untaught_tiny,
    wait_until,
)
from tests.support.processes import ServiceProcess

RUN = "two-endpoints"
SAMPLES = 12
BATCH = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return untaught_tiny(tmp_path_factory.mktemp("models"))


def test_a_worker_uses_both_endpoints_and_finishes_every_sample_after_one_is_killed(
        model_dir, data_dir, redis_url, redis_conn, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"question {i}"} for i in range(SAMPLES + 1)])
    submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name=RUN, model="tiny",
                                             generation=GenerationConfig(max_tokens=8, min_completion_tokens=0),
                                             evaluate=EvalConfig(holdout=1)))
    state = RunState(redis_conn, data_dir, RUN)
    feeder = ControllerSettings(data=data_dir, generate_batch=BATCH, feed_window=1)

    def settled() -> int:
        return sum(astuple(state.counts("generate")))

    (tmp_path / "inference-data").mkdir()
    with inference_pair(model_dir, tmp_path / "inference-data", tmp_path / "logs") as [(a, a_url), (_, b_url)]:
        # One attempt per request: a sample that succeeds after the kill got there by failing over.
        env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_INFERENCE_URL": f"{a_url},{b_url}",
               "DRAFTLINE_CONCURRENCY": "2", "DRAFTLINE_RETRY_MAX_ATTEMPTS": "1"}
        with ServiceProcess("generator", env=env, log_dir=tmp_path / "logs") as worker:
            feed_run(feeder, RunState(redis_conn, feeder.data, RUN))  # the first batch only: the feed window is one job
            wait_until(lambda: settled() == BATCH, "the first batch generated", 180, worker)
            assert served(a_url, CHAT_ENDPOINT) >= 1 and served(b_url, CHAT_ENDPOINT) >= 1
            b_before = served(b_url, CHAT_ENDPOINT)

            a.stop(signal.SIGKILL)

            def fed_and_settled() -> bool:
                feed_run(feeder, RunState(redis_conn, feeder.data, RUN))  # what the controller's loop does every tick
                return settled() == SAMPLES
            wait_until(fed_and_settled, "every sample generated with one endpoint dead", 300, worker)
        counts = state.counts("generate")
        assert (counts.done, counts.failed, counts.dropped) == (SAMPLES, 0, 0), state.failures()
        assert served(b_url, CHAT_ENDPOINT) - b_before == SAMPLES - BATCH  # the rest went to the survivor
    # Each later batch starts at an even sample id, so its first request went to the dead endpoint and
    # failed over: those are counted as retries (draftline_stage_retried_total).
    assert float(state.meta().get("generate_retried", 0)) >= (SAMPLES - BATCH) // BATCH
