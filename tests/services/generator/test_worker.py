"""A real ``draftline serve generator`` worker process drains the generate queue the controller fills."""

from __future__ import annotations

import json
import time

from services.controller.feeder import feed_run
from services.controller.submit import submit_run
from shared.jobs import EXTRACT_QUEUE, GENERATE_QUEUE, extract_job_id
from shared.queues import queue
from shared.runspec import EvalConfig, GenerationConfig
from shared.runstate import RunState
from shared.settings import ControllerSettings
from tests.services.controller.test_datasets import write_jsonl
from tests.support.openai_server import OpenAIServer, Reply
from tests.support.processes import ServiceProcess

RUN = "worker"


def test_worker_drains_the_queue_and_queues_extractions(data_dir, redis_url, redis_conn, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"w{i}"} for i in range(11)])
    submit_run(data_dir, redis_conn, dataset=str(dataset), name=RUN, model="m",
               generation=GenerationConfig(min_completion_tokens=2), evaluate=EvalConfig(holdout=1))
    state = RunState(redis_conn, data_dir, RUN)
    feeder = ControllerSettings(data=data_dir, generate_batch=3, feed_window=2)
    with OpenAIServer() as server:
        server.set_default(Reply("a perfectly ordinary answer", reasoning="some thoughts first"))
        server.script("w4", Reply(status=422, error="messages: unsupported role"))
        env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_INFERENCE_URL": server.url,
               "DRAFTLINE_CONCURRENCY": "2"}
        with ServiceProcess("generator", env=env, log_dir=tmp_path / "logs") as worker:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                feed_run(feeder, redis_conn, RUN)  # what the controller's loop does every tick
                gen = state.counts("generate")
                if gen.done + gen.failed + gen.dropped == state.expected():
                    break
                assert worker.alive(), worker.log()
                time.sleep(0.1)
            else:
                raise AssertionError(f"generation did not settle:\n{worker.log()}")
    gen = state.counts("generate")
    assert (gen.done, gen.failed, gen.dropped) == (9, 1, 0)
    assert [(f.sample_id, f.error_class) for f in state.failures()] == [(4, "InferenceRejected")]
    assert queue(GENERATE_QUEUE, redis_conn).count == 0
    assert sorted(queue(EXTRACT_QUEUE, redis_conn).get_job_ids()) == [extract_job_id(RUN, i) for i in range(10) if i != 4]
    reply = json.loads(state.paths.generated(9).read_text())["reply"]
    assert reply == {"content": "a perfectly ordinary answer", "reasoning_content": "some thoughts first"}
