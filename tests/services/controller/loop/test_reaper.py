"""The reaper gives a dead worker's job back to its queue; a live worker's job, however long, stays its own."""

from __future__ import annotations

import json
import signal
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import redis
from rq.executions import ExecutionRegistry
from rq.job import Job, JobStatus
from rq.utils import utcformat

from services.controller.loop.feeder import enqueue_once
from services.controller.loop import reaper
from services.controller.loop.reaper import requeue_abandoned
from shared.jobs import (
    EXTRACT_FUNC,
    EXTRACT_QUEUE,
    GENERATE_FUNC,
    GENERATE_QUEUE,
    QUEUES,
    ExtractJob,
    GenerateJob,
    PromptItem,
    extract_job_id,
    generate_job_id,
)
from runtime.queues import SERIALIZER, queue
from runtime.requeue import MAX_REQUEUES, REQUEUES_META
from runtime.runstate import RunState
from runtime.worker import STALE_HEARTBEAT_S, DraftlineWorker
from tests.runtime.test_worker import (
    RUN,
    gone,
    horse_of,
    make_run,
    wait_for,
    wait_started,
)
from tests.support.openai_server import OpenAIServer, Reply
from tests.support.processes import ServiceProcess

REAPER_EVERY_S = 5  # the supervisor's pace
WITHIN_S = 60  # the README: a killed worker's job runs again within a minute


def fetch(conn: redis.Redis, job_id: str) -> Job:
    return Job.fetch(job_id, connection=conn, serializer=SERIALIZER)


@pytest.mark.parametrize("job_process", ["fork", "inline"])
def test_a_killed_workers_job_is_finished_by_another_worker_and_a_live_long_job_is_left_alone(
        data_dir, redis_url, redis_conn, tmp_path, job_process):
    state = make_run(data_dir, redis_conn, tmp_path, ["doomed", "patient"])
    doomed, patient = generate_job_id(RUN, 0), generate_job_id(RUN, 1)
    env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_JOB_PROCESS": job_process}
    with OpenAIServer() as server:
        server.script("doomed", Reply("lost with its worker", delay_s=60), Reply("done by another worker"))
        server.script("patient", Reply("a long but healthy reply", delay_s=45))
        env["DRAFTLINE_INFERENCE_URL"] = server.url
        workers = [ServiceProcess("generator", env=env, log_dir=tmp_path / "logs").start() for _ in range(2)]
        try:
            wait_started(redis_conn, doomed, *workers)
            wait_started(redis_conn, patient, *workers)
            for prompt in ("doomed", "patient"):  # mid-job: the request is in flight
                wait_for(lambda p=prompt: server.requests_for(p), f"{prompt} request sent", 60, *workers)
            killed_name = fetch(redis_conn, doomed).worker_name
            patient_worker = fetch(redis_conn, patient).worker_name
            [victim] = [w for w in workers if killed_name.endswith(f"-{w.proc.pid}")]
            horses = [horse_of(victim)] if job_process == "fork" else []  # inline: the job runs in the worker
            victim.stop(signal.SIGKILL)  # the worker only: its horse sits in a process group of its own
            killed_at = time.monotonic()
            wait_for(lambda: all(gone(horse) for horse in horses), "the dead worker's work horse gone", 10)
            workers.append(ServiceProcess("generator", env=env, log_dir=tmp_path / "logs").start())

            requeued, finished_in = 0, None
            while True:
                done = {j for j in (doomed, patient) if fetch(redis_conn, j).get_status() == JobStatus.FINISHED}
                if doomed in done and finished_in is None:
                    finished_in = time.monotonic() - killed_at
                if done == {doomed, patient}:
                    break
                assert time.monotonic() - killed_at < WITHIN_S + 60, "\n".join(w.log() for w in workers)
                requeued += requeue_abandoned(redis_conn)  # what the supervisor does every few seconds
                time.sleep(REAPER_EVERY_S)
        finally:
            for worker in workers:
                worker.stop(signal.SIGKILL)
    assert finished_in < WITHIN_S, f"the killed worker's job took {finished_in:.0f}s to finish elsewhere"
    assert requeued == 1
    again = fetch(redis_conn, doomed)
    assert again.meta[REQUEUES_META] == 1 and again.worker_name != killed_name
    assert json.loads(state.paths.generated(0).read_text())["reply"]["content"] == "done by another worker"
    healthy = fetch(redis_conn, patient)
    assert REQUEUES_META not in healthy.meta and healthy.worker_name == patient_worker
    assert json.loads(state.paths.generated(1).read_text())["reply"]["content"] == "a long but healthy reply"
    assert len(server.requests_for("patient")) == 1
    assert state.counts("generate").done == 2
    assert_no_execution_records(redis_conn, doomed)
    # What the supervisor does when it meets a finished job's id again: replace it, without an error.
    payload = fetch(redis_conn, doomed).args[0]
    assert enqueue_once(redis_conn, GENERATE_QUEUE, GENERATE_FUNC, payload, doomed, timeout=60)


def assert_no_execution_records(conn: redis.Redis, job_id: str) -> None:
    """No execution of ``job_id`` is left in any of the places rq 3 records executions."""
    assert conn.zrange(ExecutionRegistry(job_id=job_id, connection=conn).key, 0, -1) == []
    assert list(conn.scan_iter(match=f"rq:execution:{job_id}:*")) == []
    for key in conn.scan_iter(match="rq:worker:*:executions"):
        assert not [m for m in conn.smembers(key) if m.decode().startswith(f"{job_id}:")], key
    for name in QUEUES:
        started = queue(name, conn).started_job_registry.key
        assert not [m for m in conn.zrange(started, 0, -1) if m.decode().startswith(f"{job_id}:")]


def take(conn: redis.Redis, name: str, queue_name: str = GENERATE_QUEUE) -> tuple[DraftlineWorker, Job]:
    """The next job of ``queue_name`` taken by a worker as RQ takes it (dequeue, execution, started), with
    no process behind it, so a test can then age, mark or delete the worker's records."""
    q = queue(queue_name, conn)
    worker = DraftlineWorker([q], connection=conn, serializer=SERIALIZER, name=name)
    worker.register_birth()
    worker.heartbeat()
    job, _ = q.dequeue_any([q], None, connection=conn, serializer=SERIALIZER)
    worker.prepare_execution(job)
    with conn.pipeline() as pipe:
        job.prepare_for_execution(worker.name, pipe)
        pipe.execute()
    return worker, job


def started_by_a_worker(conn: redis.Redis, job_id: str = "generate_r_00000000") -> tuple[DraftlineWorker, Job]:
    queue(GENERATE_QUEUE, conn).enqueue_call("services.generator.jobs.generate", args=({},), job_id=job_id)
    return take(conn, f"w-{job_id}")


def age_heartbeat(conn: redis.Redis, worker: DraftlineWorker, seconds: float) -> None:
    then = datetime.now(timezone.utc) - timedelta(seconds=seconds)
    conn.hset(worker.key, "last_heartbeat", utcformat(then))


def test_a_fresh_heartbeat_keeps_the_job_and_a_stale_one_gives_it_back_once(redis_conn):
    worker, job = started_by_a_worker(redis_conn)
    q = queue(GENERATE_QUEUE, redis_conn)
    age_heartbeat(redis_conn, worker, STALE_HEARTBEAT_S - 5)
    assert requeue_abandoned(redis_conn) == 0
    assert job.id in q.started_job_registry.get_job_ids(cleanup=False) and q.get_job_ids() == []
    age_heartbeat(redis_conn, worker, STALE_HEARTBEAT_S + 1)
    assert requeue_abandoned(redis_conn, QUEUES) == 1
    assert requeue_abandoned(redis_conn, QUEUES) == 0  # claimed once: a second pass finds nothing to do
    assert q.get_job_ids() == [job.id]
    assert q.started_job_registry.get_job_ids(cleanup=False) == []
    assert worker.get_current_executions() == []
    assert fetch(redis_conn, job.id).get_status() == JobStatus.QUEUED


def test_a_cold_shutdowns_job_is_requeued_without_waiting_for_its_heartbeat_to_age(redis_conn):
    worker, job = started_by_a_worker(redis_conn)
    worker.register_death()  # what a worker does on its way out, after killing its horse
    assert requeue_abandoned(redis_conn) == 1
    assert queue(GENERATE_QUEUE, redis_conn).get_job_ids() == [job.id]


def test_a_worker_whose_hash_expired_is_dead(redis_conn):
    worker, _ = started_by_a_worker(redis_conn)
    redis_conn.delete(worker.key)
    assert requeue_abandoned(redis_conn, [GENERATE_QUEUE]) == 1
    assert requeue_abandoned(redis_conn, ["draftline-extract"]) == 0


def test_a_job_that_keeps_killing_its_worker_is_failed_after_the_last_requeue(redis_conn):
    worker, job = started_by_a_worker(redis_conn)
    for round_ in range(MAX_REQUEUES + 1):
        if round_:
            worker, job = take(redis_conn, f"w-round-{round_}")
        redis_conn.delete(worker.key)
        assert requeue_abandoned(redis_conn) == (1 if round_ < MAX_REQUEUES else 0), round_
    job = fetch(redis_conn, job.id)
    assert job.get_status() == JobStatus.FAILED
    reason = job.latest_result().exc_string
    assert f"execution lost {MAX_REQUEUES + 1} times" in reason and "worker w-round-3 is dead" in reason
    assert queue(GENERATE_QUEUE, redis_conn).get_job_ids() == []


def test_each_requeue_counts_a_retry_of_every_sample_of_the_job(redis_conn):
    items = [PromptItem(sample_id=i, messages=[{"role": "user", "content": f"p{i}"}]) for i in range(3)]
    queue(GENERATE_QUEUE, redis_conn).enqueue_call(GENERATE_FUNC, args=(
        GenerateJob(run="counted", items=items).model_dump(mode="json"),), job_id=generate_job_id("counted", 0))
    queue(EXTRACT_QUEUE, redis_conn).enqueue_call(EXTRACT_FUNC, args=(
        ExtractJob(run="counted", sample_ids=[7, 8]).model_dump(mode="json"),), job_id=extract_job_id("counted", 7))
    workers = [take(redis_conn, "w-gen")[0], take(redis_conn, "w-ext", EXTRACT_QUEUE)[0]]
    for worker in workers:
        redis_conn.delete(worker.key)
    assert requeue_abandoned(redis_conn) == 2
    meta = RunState(redis_conn, Path(), "counted").meta()
    assert (float(meta["generate_retried"]), float(meta["extract_retried"])) == (3, 2)


def test_a_requeued_job_leaves_no_execution_record_and_goes_to_the_front_of_its_queue(redis_conn):
    worker, job = started_by_a_worker(redis_conn)
    executions = [e.id for e in job.get_executions()]
    assert executions and worker.get_current_executions()  # the records the reaper must clean
    q = queue(GENERATE_QUEUE, redis_conn)
    waiting = [q.enqueue_call(GENERATE_FUNC, args=({},), job_id=f"generate_r_0000000{i}").id for i in (1, 2)]
    redis_conn.delete(worker.key)
    assert requeue_abandoned(redis_conn) == 1
    assert q.get_job_ids() == [job.id, *waiting]  # it waited its turn once already
    assert_no_execution_records(redis_conn, job.id)
    again = fetch(redis_conn, job.id)
    assert again.get_executions() == []  # rq's own reader: a stale id here raised "not found in Redis"


def test_a_job_its_dying_worker_took_off_the_queue_but_never_started_is_requeued_not_lost(redis_conn):
    q = queue(GENERATE_QUEUE, redis_conn)
    q.enqueue_call("services.generator.jobs.generate", args=({},), job_id="generate_r_00000009")
    q.enqueue_call("services.generator.jobs.generate", args=({},), job_id="generate_r_00000010")
    # What a worker killed right after its dequeue leaves: the job in RQ's intermediate list, not started.
    job, _ = q.dequeue_any([q], None, connection=redis_conn, serializer=SERIALIZER)
    assert job.id == "generate_r_00000009" and q.intermediate_queue.get_job_ids() == [job.id]
    _, started = take(redis_conn, "w-live")  # the other job, started by a live worker: never touched
    assert requeue_abandoned(redis_conn) == 0  # first seen now: a live worker starts a job within milliseconds
    key = reaper.FIRST_SEEN_KEY.format(queue=q.name, job=job.id)
    redis_conn.set(key, time.time() - reaper.STUCK_DEQUEUED_S + 2)
    assert requeue_abandoned(redis_conn) == 0
    redis_conn.set(key, time.time() - reaper.STUCK_DEQUEUED_S - 1)
    assert requeue_abandoned(redis_conn) == 1
    assert requeue_abandoned(redis_conn) == 0  # claimed once
    assert q.get_job_ids() == [job.id] and job.id not in q.intermediate_queue.get_job_ids()
    again = fetch(redis_conn, job.id)
    assert again.get_status() == JobStatus.QUEUED and again.meta[REQUEUES_META] == 1
    assert started.id in q.started_job_registry.get_job_ids(cleanup=False)
    assert not redis_conn.exists(key)


def test_a_job_that_left_the_intermediate_list_leaves_no_first_seen_mark(redis_conn):
    q = queue(EXTRACT_QUEUE, redis_conn)
    redis_conn.rpush(q.intermediate_queue_key, "extract_waiting_00000001")
    left = reaper.FIRST_SEEN_KEY.format(queue=q.name, job="extract_started_00000002")
    redis_conn.set(left, time.time(), ex=3600)  # seen there once, on its way to a worker that started it
    reaper.requeue_stuck_dequeued(q, time.time(), stuck_after_s=3600)
    assert not redis_conn.exists(left)
    assert redis_conn.exists(reaper.FIRST_SEEN_KEY.format(queue=q.name, job="extract_waiting_00000001"))
