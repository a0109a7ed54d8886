"""A real ``draftline serve generator`` worker process drains the generate queue the controller fills, gives a job
back when told to stop while part of it waits, and Redis keeps the sample jobs it ran only as long as
``sample_result_ttl_s`` says."""

from __future__ import annotations

import json
import signal
import time

from rq.job import Job, JobStatus
from rq.registry import FinishedJobRegistry

from services.controller.loop.failures import name_failed_jobs
from services.controller.loop.feeder import enqueue_once, feed_run
from services.controller.runs.submit import submit_run
from shared.jobs import GENERATE_FUNC, GENERATE_QUEUE, GenerateJob, PromptItem, extract_job_id, generate_job_id
from runtime.queues import SERIALIZER, queue
from runtime.requeue import REQUEUES_META
from runtime.shutdown import DRAIN_DEADLINE_S
from shared.runspec import EvalConfig, GenerationConfig, RunSpec
from runtime.runstate import GENERATE_REQUESTS, RunState
from shared.settings import ControllerSettings
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.support.openai_server import OpenAIServer, Reply
from tests.runtime.test_worker import EXIT_AFTER_JOB_S, wait_for
from tests.support.processes import ServiceProcess
from tests.support.queues import extract_batches, queued_extractions
from tests.support.workers import successful_jobs

RUN = "worker"


def test_worker_drains_the_queue_and_queues_extractions(data_dir, redis_url, redis_conn, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"w{i}"} for i in range(11)])
    submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name=RUN, model="m",
                                             generation=GenerationConfig(min_completion_tokens=2),
                                             evaluate=EvalConfig(holdout=1)))
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
                feed_run(feeder, RunState(redis_conn, feeder.data, RUN))  # what the controller's loop does every tick
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
    assert queued_extractions(redis_conn) == [i for i in range(10) if i != 4]  # each reply's extraction, once
    reply = json.loads(state.paths.generated(9).read_text())["reply"]
    assert reply == {"content": "a perfectly ordinary answer", "reasoning_content": "some thoughts first"}


def test_a_stopped_generator_keeps_the_replies_it_got_and_its_job_run_again_asks_only_for_the_rest(
        data_dir, redis_url, redis_conn, tmp_path):
    """One job of two samples: the server answers the first and has no disk space for the second (507), which
    waits. On a first SIGTERM the first reply is marked and its extraction queued, the second goes back with the
    job, unsettled, and nothing failed; run again, the job asks the server only for the second."""
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": p} for p in ("answered", "no room for it", "held out")])
    submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name=RUN, model="m",
                                             generation=GenerationConfig(min_completion_tokens=1),
                                             evaluate=EvalConfig(holdout=1)))
    state = RunState(redis_conn, data_dir, RUN)
    items = [PromptItem(**json.loads(line)) for line in state.paths.prompts.read_text().splitlines()]
    ids = {item.messages[-1]["content"]: item.sample_id for item in items}
    answered, waited = ids["answered"], ids["no room for it"]
    job_id = generate_job_id(RUN, items[0].sample_id)
    queue(GENERATE_QUEUE, redis_conn).enqueue_call(
        GENERATE_FUNC, args=(GenerateJob(run=RUN, items=items).model_dump(mode="json"),), job_id=job_id, timeout=600)
    with OpenAIServer() as server:
        server.script("answered", Reply("kept across the stop"))
        server.script("no room for it", Reply(status=507, error="no space left on the server's volume"))
        env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_INFERENCE_URL": server.url}
        worker = ServiceProcess("generator", env=env, log_dir=tmp_path / "logs").start()
        try:
            wait_for(lambda: "has no disk space" in worker.full_log(), "the second sample waiting", 60, worker)
            worker.proc.send_signal(signal.SIGTERM)
            assert worker.proc.wait(DRAIN_DEADLINE_S + EXIT_AFTER_JOB_S) == 0, worker.log()
        finally:
            worker.stop(signal.SIGKILL)
        assert state.is_done("generate", answered) and not state.is_done("generate", waited)
        assert state.counts("generate").failed == 0 and state.failures() == []
        assert queue(GENERATE_QUEUE, redis_conn).get_job_ids() == [job_id]
        assert REQUEUES_META not in Job.fetch(job_id, connection=redis_conn, serializer=SERIALIZER).meta
        assert queued_extractions(redis_conn) == [answered]

        server.script("no room for it", Reply("written once the server had room"))
        with ServiceProcess("generator", env=env, log_dir=tmp_path / "logs") as worker:
            wait_for(lambda: state.counts("generate").done == 2, "both samples generated", 60, worker)
    assert len(server.requests_for("answered")) == 1  # its reply was kept: not asked again
    replies = {i: json.loads(state.paths.generated(i).read_text())["reply"]["content"] for i in (answered, waited)}
    assert replies == {answered: "kept across the stop", waited: "written once the server had room"}
    assert state.counts("generate").failed == 0
    assert queued_extractions(redis_conn) == sorted([answered, waited])  # each reply's extraction, once
    meta = state.meta()  # counted once each, across the stop
    assert float(meta[GENERATE_REQUESTS]) == 2
    assert float(meta["generated_bytes"]) == sum(state.paths.generated(i).stat().st_size for i in (answered, waited))


# ---- how long Redis keeps a sample job once it ended -----------------------------------------------

TTL_RUN = "kept"
WEEK_S = 7 * 24 * 3600


def generate_one_good_and_one_broken_job(data_dir, redis_url, redis_conn, tmp_path, ttl_env: dict[str, str],
                                         feeder: ControllerSettings) -> tuple[RunState, str, str]:
    """One generate job of samples 0-2 that succeeds and one of sample 3 that fails (its payload has a field
    no GenerateJob has), run by a real generator worker; (state, good job id, broken job id) once the worker
    has settled both in RQ."""
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"k{i}"} for i in range(5)])
    submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name=TTL_RUN, model="m",
                                             generation=GenerationConfig(min_completion_tokens=1),
                                             evaluate=EvalConfig(holdout=1)))
    state = RunState(redis_conn, data_dir, TTL_RUN)
    good, broken = generate_job_id(TTL_RUN, 0), generate_job_id(TTL_RUN, 3)
    payload = {"run": TTL_RUN, "items": [{"sample_id": 3, "messages": []}], "unknown_field": 1}
    assert enqueue_once(redis_conn, GENERATE_QUEUE, GENERATE_FUNC, payload, broken, 60,
                        result_ttl=feeder.sample_result_ttl_s)
    assert feed_run(feeder, RunState(redis_conn, feeder.data, TTL_RUN)) == 1  # samples 0-2; sample 3 is the broken job's
    failed = queue(GENERATE_QUEUE, redis_conn).failed_job_registry
    with OpenAIServer() as server:
        server.set_default(Reply("an answer"))
        env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_INFERENCE_URL": server.url,
               **ttl_env}
        with ServiceProcess("generator", env=env, log_dir=tmp_path / "logs") as worker:
            wait_for(lambda: broken in failed.get_job_ids() and state.counts("generate").done == 3
                     and sum(successful_jobs(redis_conn).values()) == 1, "one job finished, one failed", 60, worker)
    return state, good, broken


def test_a_finished_sample_job_leaves_redis_at_once_and_a_failed_one_stays_until_its_samples_are_named(
        data_dir, redis_url, redis_conn, tmp_path):
    feeder = ControllerSettings(data=data_dir, generate_batch=3)
    assert feeder.sample_result_ttl_s == 0  # the default
    state, good, broken = generate_one_good_and_one_broken_job(data_dir, redis_url, redis_conn, tmp_path, {}, feeder)
    assert not redis_conn.exists(Job.key_for(good))
    assert FinishedJobRegistry(GENERATE_QUEUE, connection=redis_conn).count == 0
    extractions = [extract_job_id(TTL_RUN, 0)]
    assert extract_batches(redis_conn) == {extractions[0]: [0, 1, 2]}  # the generate job's replies, one extract job
    assert {redis_conn.hget(Job.key_for(job_id), "result_ttl") for job_id in extractions} == {b"0"}
    # The failed job stays a week, long enough for the controller to name its sample on the volume.
    assert Job.fetch(broken, connection=redis_conn, serializer=SERIALIZER).get_status() == JobStatus.FAILED
    assert WEEK_S - 60 < redis_conn.ttl(Job.key_for(broken)) <= WEEK_S
    assert name_failed_jobs(data_dir, redis_conn) == 1
    record = json.loads(state.paths.failure("generate", 3).read_text())
    assert record["error_class"] == "JobFailed" and broken in record["message"]
    assert not redis_conn.exists(Job.key_for(broken))


def test_a_finished_sample_job_is_kept_for_the_set_ttl_then_is_gone(data_dir, redis_url, redis_conn, tmp_path):
    # Long enough that the worker's stop (seconds on a loaded 2-core machine) never outlasts it: CI once found
    # the job already gone at ttl = 3.
    ttl = 15
    feeder = ControllerSettings(data=data_dir, generate_batch=3, sample_result_ttl_s=ttl)
    _, good, broken = generate_one_good_and_one_broken_job(
        data_dir, redis_url, redis_conn, tmp_path, {"DRAFTLINE_SAMPLE_RESULT_TTL_S": str(ttl)}, feeder)
    finished = FinishedJobRegistry(GENERATE_QUEUE, connection=redis_conn, serializer=SERIALIZER)
    assert Job.fetch(good, connection=redis_conn, serializer=SERIALIZER).get_status() == JobStatus.FINISHED
    assert 0 < redis_conn.ttl(Job.key_for(good)) <= ttl and finished.get_job_ids() == [good]
    # The generator read the same setting for the extractions it queued.
    assert redis_conn.hget(Job.key_for(extract_job_id(TTL_RUN, 0)), "result_ttl") == str(ttl).encode()
    wait_for(lambda: not redis_conn.exists(Job.key_for(good)), "the finished job's expiry", ttl + 5)
    assert finished.get_job_ids() == []
    assert Job.fetch(broken, connection=redis_conn, serializer=SERIALIZER).get_status() == JobStatus.FAILED
