"""Real ``draftline serve generator`` workers stop cleanly: SIGTERM finishes the job, a second one stops now;
in both ways a worker runs jobs (a forked work horse, or inline in its own process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import redis
from rq.job import Job, JobStatus

from services.controller.loop.reaper import requeue_abandoned
from services.controller.runs.submit import submit_run
from shared.jobs import (
    GENERATE_FUNC,
    GENERATE_QUEUE,
    GenerateJob,
    PromptItem,
    generate_job_id,
)
from runtime.queues import SERIALIZER, queue
from runtime.requeue import MAX_REQUEUES, REQUEUES_META
from shared.runspec import EvalConfig, GenerationConfig, RunSpec
from runtime.runstate import RunState
from runtime.shutdown import DRAIN_DEADLINE_S
import runtime.worker
from runtime.worker import JOB_MONITORING_INTERVAL_S, DraftlineWorker, horse_loss, overran
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.support.openai_server import OpenAIServer, Reply
from tests.support.processes import RedisServer, ServiceProcess

RUN = "stopping"


def make_run(data_dir: Path, conn: redis.Redis, tmp_path: Path, prompts: list[str], run: str = RUN, *,
             result_ttl: int = 3600) -> RunState:
    """A submitted run with one generate job per prompt on the queue (sample ids in prompt order)."""
    dataset = write_jsonl(tmp_path / f"{run}.jsonl", [{"prompt": p} for p in prompts] + [{"prompt": "held out"}])
    submit_run(data_dir, conn, RunSpec(dataset=str(dataset), name=run, model="m",
                                       generation=GenerationConfig(min_completion_tokens=1),
                                       evaluate=EvalConfig(holdout=1)))
    state = RunState(conn, data_dir, run)
    for line in state.paths.prompts.read_text().splitlines():
        item = PromptItem(**json.loads(line))
        queue(GENERATE_QUEUE, conn).enqueue_call(
            GENERATE_FUNC, args=(GenerateJob(run=run, items=[item]).model_dump(mode="json"),),
            job_id=generate_job_id(run, item.sample_id), timeout=600, result_ttl=result_ttl, failure_ttl=3600,
        )
    return state


def generator(server: OpenAIServer, redis_url: str, data_dir: Path, tmp_path: Path,
              job_process: str = "fork") -> ServiceProcess:
    env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_INFERENCE_URL": server.url,
           "DRAFTLINE_JOB_PROCESS": job_process}
    return ServiceProcess("generator", env=env, log_dir=tmp_path / "logs")


def job_status(conn: redis.Redis, job_id: str) -> JobStatus:
    return Job.fetch(job_id, connection=conn, serializer=SERIALIZER).get_status()


def wait_for(condition, what: str, timeout: float, *workers: ServiceProcess) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            logs = "\n".join(w.log() for w in workers)
            raise AssertionError(f"{what} not within {timeout}s:\n{logs}")
        time.sleep(0.1)


def wait_started(conn: redis.Redis, job_id: str, *workers: ServiceProcess) -> None:
    """Until the work horse runs the job (RQ marks it started only inside the horse)."""
    wait_for(lambda: job_status(conn, job_id) == JobStatus.STARTED, f"{job_id} started", 60, *workers)


def children_of(worker: ServiceProcess) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(worker.proc.pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def horse_of(worker: ServiceProcess) -> int:
    """The pid of the worker's work horse (its one child process)."""
    pids = children_of(worker)
    assert len(pids) == 1, f"worker {worker.proc.pid} has children {pids}"
    return pids[0]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie is dead too; it waits for its reaper (init, once its parent worker is gone).
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "State:\tZ" in status.read_text()


# A warm shutdown's bound once the job is done: the worker records its death and lets its command channel go
# (runtime.worker.UNSUBSCRIBE_WAIT_S at most). RQ's own order could wait out the channel's 60 s poll.
EXIT_AFTER_JOB_S = 15.0


@pytest.mark.parametrize("job_process", ["fork", "inline"])
def test_first_sigterm_finishes_the_current_job_then_exits_zero_within_its_deadline(data_dir, redis_url, redis_conn,
                                                                                    tmp_path, job_process):
    state = make_run(data_dir, redis_conn, tmp_path, ["slow"])
    job_id = generate_job_id(RUN, 0)
    with OpenAIServer() as server:
        server.script("slow", Reply("finished despite the signal", delay_s=3))
        worker = generator(server, redis_url, data_dir, tmp_path, job_process).start()
        try:
            wait_started(redis_conn, job_id, worker)
            worker.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: job_status(redis_conn, job_id) == JobStatus.FINISHED, "the job finished", 60, worker)
            finished = time.monotonic()
            assert worker.proc.wait(60) == 0, worker.log()
            assert time.monotonic() - finished < EXIT_AFTER_JOB_S, worker.log()
        finally:
            worker.stop(signal.SIGKILL)
    assert job_status(redis_conn, job_id) == JobStatus.FINISHED
    assert json.loads(state.paths.generated(0).read_text())["reply"]["content"] == "finished despite the signal"
    assert state.counts("generate").done == 1
    assert "warm shut down requested" in worker.full_log()


@pytest.mark.parametrize("job_process", ["fork", "inline"])
def test_second_sigterm_stops_at_once_and_the_job_is_not_done(data_dir, redis_url, redis_conn, tmp_path, job_process):
    state = make_run(data_dir, redis_conn, tmp_path, ["very slow"])
    job_id = generate_job_id(RUN, 0)
    with OpenAIServer() as server:
        server.script("very slow", Reply("never written", delay_s=120))
        worker = generator(server, redis_url, data_dir, tmp_path, job_process).start()
        try:
            wait_started(redis_conn, job_id, worker)
            wait_for(lambda: server.requests_for("very slow"), "the request sent", 60, worker)
            horses = children_of(worker)
            assert len(horses) == (1 if job_process == "fork" else 0), horses
            worker.proc.send_signal(signal.SIGTERM)
            time.sleep(1.5)  # RQ ignores a second signal within a second of the first (a pool's duplicate)
            worker.proc.send_signal(signal.SIGTERM)
            worker.proc.wait(30)  # far less than the 120 s reply: the job was cut short
        finally:
            worker.stop(signal.SIGKILL)
        assert "cold shut down" in worker.full_log()
        wait_for(lambda: all(gone(horse) for horse in horses), "work horse gone", 10)
    assert job_status(redis_conn, job_id) == JobStatus.STARTED  # never marked done ...
    assert not state.paths.generated(0).exists()
    assert state.counts("generate").done == 0
    assert requeue_abandoned(redis_conn) == 1  # ... but left for the reaper: the worker recorded its death
    assert job_status(redis_conn, job_id) == JobStatus.QUEUED


@pytest.mark.parametrize("job_process", ["fork", "inline"])
def test_first_sigterm_gives_a_job_waiting_for_a_down_server_back_at_the_front_and_exits_within_the_deadline(
        data_dir, redis_url, redis_conn, tmp_path, job_process):
    """What was seen in production: a generator whose inference server is down waits for it, and a first SIGTERM
    used to leave it waiting (logging "is down for 1m ... 4m") until a second one stopped it cold. Now the job
    gives its samples back within the deadline: at the front of its queue, nothing failed, no retry counted;
    and the job run again once the server is back asks for each sample once."""
    state = make_run(data_dir, redis_conn, tmp_path, ["waits for the server", "queued behind it"])
    waiting, behind = generate_job_id(RUN, 0), generate_job_id(RUN, 1)
    server = OpenAIServer()  # its port is chosen now; nothing listens on it until it starts below
    worker = generator(server, redis_url, data_dir, tmp_path, job_process).start()
    try:
        wait_started(redis_conn, waiting, worker)
        wait_for(lambda: "is down" in worker.full_log() and "waiting for it" in worker.full_log(),
                 "the job waiting for the server", 60, worker)
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(DRAIN_DEADLINE_S + EXIT_AFTER_JOB_S) == 0, worker.log()
    finally:
        worker.stop(signal.SIGKILL)
    q = queue(GENERATE_QUEUE, redis_conn)
    assert q.get_job_ids() == [waiting, behind]  # back at the front, before the job that waited its turn
    assert job_status(redis_conn, waiting) == JobStatus.QUEUED
    assert q.started_job_registry.get_job_ids(cleanup=False) == [] and q.failed_job_registry.get_job_ids() == []
    assert REQUEUES_META not in Job.fetch(waiting, connection=redis_conn, serializer=SERIALIZER).meta
    counts = state.counts("generate")
    assert (counts.done, counts.failed, counts.dropped) == (0, 0, 0) and state.failures() == []
    assert "generate_retried" not in state.meta()
    assert f"job {waiting} yielded" in worker.full_log() and "cold shut down" not in worker.full_log()

    with server:
        server.script("waits for the server", Reply("answered once the server is back"))
        server.script("queued behind it", Reply("answered next"))
        worker = generator(server, redis_url, data_dir, tmp_path, job_process).start()
        try:
            wait_for(lambda: state.counts("generate").done == 2, "both samples generated", 60, worker)
        finally:
            worker.stop()
    assert [len(server.requests_for(p)) for p in ("waits for the server", "queued behind it")] == [1, 1]
    assert json.loads(state.paths.generated(0).read_text())["reply"]["content"] == "answered once the server is back"
    assert state.counts("generate").failed == 0 and "generate_retried" not in state.meta()


def test_a_killed_work_horse_is_requeued_at_the_front_and_its_job_finishes_without_a_failure(
        data_dir, redis_url, redis_conn, tmp_path):
    """What the kernel's OOM killer does: SIGKILL the work horse only. Its worker lives, puts the job back
    at the front of the queue at once (a retry, not a failure) and runs it again."""
    state = make_run(data_dir, redis_conn, tmp_path, ["oom victim", "waiting its turn"])
    victim, waiting = generate_job_id(RUN, 0), generate_job_id(RUN, 1)
    with OpenAIServer() as server:
        server.script("oom victim", Reply("never written", delay_s=120), Reply("written the second time"))
        server.script("waiting its turn", Reply("second in line"))
        worker = generator(server, redis_url, data_dir, tmp_path).start()
        try:
            wait_started(redis_conn, victim, worker)
            wait_for(lambda: server.requests_for("oom victim"), "the victim's request sent", 60, worker)
            assert queue(GENERATE_QUEUE, redis_conn).get_job_ids() == [waiting]
            os.kill(horse_of(worker), signal.SIGKILL)
            wait_for(lambda: job_status(redis_conn, victim) == JobStatus.FINISHED, "the victim finished", 60, worker)
            wait_for(lambda: job_status(redis_conn, waiting) == JobStatus.FINISHED, "the next job finished", 60,
                     worker)
            assert worker.alive(), worker.log()
        finally:
            worker.stop(signal.SIGKILL)
    assert json.loads(state.paths.generated(0).read_text())["reply"]["content"] == "written the second time"
    job = Job.fetch(victim, connection=redis_conn, serializer=SERIALIZER)
    assert job.meta[REQUEUES_META] == 1 and job.get_status() == JobStatus.FINISHED
    # Front of the queue: the victim ran again before the job that was waiting when it was killed.
    assert job.ended_at < Job.fetch(waiting, connection=redis_conn, serializer=SERIALIZER).started_at
    assert state.counts("generate").done == 2 and state.counts("generate").failed == 0
    assert float(state.meta()["generate_retried"]) == 1
    assert "killed by SIGKILL; requeued at the front" in worker.full_log()


def test_a_job_whose_work_horse_keeps_being_killed_fails_by_name_after_the_last_requeue(
        data_dir, redis_url, redis_conn, tmp_path):
    make_run(data_dir, redis_conn, tmp_path, ["kills its horse"])
    victim = generate_job_id(RUN, 0)
    with OpenAIServer() as server:
        server.script("kills its horse", Reply("never written", delay_s=120))
        worker = generator(server, redis_url, data_dir, tmp_path).start()
        try:
            for death in range(MAX_REQUEUES + 1):
                wait_for(lambda n=death: len(server.requests_for("kills its horse")) > n,
                         f"attempt {death + 1} sent", 60, worker)
                os.kill(horse_of(worker), signal.SIGKILL)
            wait_for(lambda: job_status(redis_conn, victim) == JobStatus.FAILED, "the job failed", 60, worker)
        finally:
            worker.stop(signal.SIGKILL)
    reason = Job.fetch(victim, connection=redis_conn, serializer=SERIALIZER).latest_result().exc_string
    assert f"execution lost {MAX_REQUEUES + 1} times" in reason and "killed by SIGKILL" in reason


def test_a_horse_the_worker_kills_for_overrunning_its_timeout_is_a_failure_not_a_loss():
    job = Job(id="j", connection=redis.Redis())
    job.timeout, job.started_at = 10, datetime.now(timezone.utc) - timedelta(seconds=71)
    assert overran(job)
    job.started_at = datetime.now(timezone.utc) - timedelta(seconds=69)  # a kill from outside, in time
    assert not overran(job)
    job.timeout = -1  # no timeout: never an overrun
    assert not overran(job)


@pytest.mark.parametrize("job_process", ["fork", "inline"])
def test_workers_outlive_a_redis_restart_and_the_job_in_flight_is_finished(data_dir, tmp_path, tiny_model_dir,
                                                                          job_process):
    """Redis restarts empty (no persistence) while a generator runs a job and an extractor and a trainer
    wait: all three live on, log the outage once and its end once, and the generator finishes its job
    on the volume and then serves a job queued after the restart."""
    server_dir = tmp_path / "redis"
    redis_server = RedisServer(server_dir).start()
    conn = redis.Redis.from_url(redis_server.url)
    state = make_run(data_dir, conn, tmp_path, ["through the outage"])
    env = {"REDIS_URL": redis_server.url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_MODEL_DIR": str(tiny_model_dir),
           "DRAFTLINE_JOB_PROCESS": job_process}
    with OpenAIServer() as server:
        server.script("through the outage", Reply("finished across a redis restart", delay_s=30))
        server.script("after the outage", Reply("served after the restart"))
        env["DRAFTLINE_INFERENCE_URL"] = server.url
        workers = [ServiceProcess(name, env=env, log_dir=tmp_path / "logs").start()
                   for name in ("generator", "extractor", "trainer")]
        try:
            wait_for(lambda: len(conn.smembers("rq:workers")) == 3, "three workers registered", 60, *workers)
            wait_started(conn, generate_job_id(RUN, 0), *workers)
            wait_for(lambda: server.requests_for("through the outage"), "the request sent", 60, *workers)
            redis_server.stop()
            time.sleep(JOB_MONITORING_INTERVAL_S + 2)  # a busy worker heartbeats once meanwhile: it meets the outage
            redis_server = RedisServer(server_dir, port=redis_server.port).start()
            wait_for(lambda: state.paths.generated(0).exists(), "the in-flight reply on the volume", 60, *workers)
            wait_for(lambda: len(conn.smembers("rq:workers")) == 3, "the workers registered again", 60, *workers)
            # Redis came back empty: the run is the controller's to rebuild; a new job shows the worker serves.
            item = PromptItem(sample_id=1, messages=[{"role": "user", "content": "after the outage"}])
            queue(GENERATE_QUEUE, conn).enqueue_call(
                GENERATE_FUNC, args=(GenerateJob(run=RUN, items=[item]).model_dump(mode="json"),),
                job_id=generate_job_id(RUN, 1), timeout=600)
            wait_for(lambda: state.paths.generated(1).exists(), "a job queued after the restart done", 60, *workers)
            assert all(w.alive() for w in workers), "\n".join(w.log() for w in workers)
        finally:
            for worker in workers:
                worker.stop(signal.SIGKILL)
            redis_server.stop()
    assert json.loads(state.paths.generated(0).read_text())["reply"]["content"] == "finished across a redis restart"
    assert len(server.requests_for("through the outage")) == 1  # finished once, not run twice
    for worker in workers:
        log = worker.full_log()
        assert log.count("waiting for it with backoff") == 1, log
        assert log.count("redis is back after") == 1, log
        assert "unhandled exception" not in log, log


@pytest.mark.parametrize("job_process", ["fork", "inline"])
def test_a_job_whose_record_redis_loses_while_it_runs_finishes_and_is_not_failed(data_dir, redis_url, redis_conn,
                                                                                tmp_path, job_process):
    """Redis is flushed (or restarts empty) while a job runs: the job ends on the volume, and its worker
    writes no failed record of it into the new Redis, which the controller would take for a failure of its
    samples after its rebuild had sent them back to be redone (tests/services/controller/loop/test_redis_loss.py
    met exactly that)."""
    # Deleted as it ends, as the controller queues sample jobs (DRAFTLINE_SAMPLE_RESULT_TTL_S, default 0).
    state = make_run(data_dir, redis_conn, tmp_path, ["while redis is flushed"], result_ttl=0)
    job_id = generate_job_id(RUN, 0)
    with OpenAIServer() as server:
        server.script("while redis is flushed", Reply("finished after the flush", delay_s=2))
        worker = generator(server, redis_url, data_dir, tmp_path, job_process).start()
        try:
            wait_for(lambda: server.requests_for("while redis is flushed"), "the request sent", 60, worker)
            redis_conn.flushall()
            wait_for(lambda: "no longer holds its record" in worker.full_log(), "the job's end", 60, worker)
            assert worker.alive(), worker.log()
        finally:
            worker.stop()
    assert state.paths.generated(0).is_file()
    assert queue(GENERATE_QUEUE, redis_conn).failed_job_registry.get_job_ids() == []
    assert not redis_conn.exists(f"rq:job:{job_id}")
    assert "exception raised while executing" not in worker.full_log(), worker.log()


@pytest.mark.parametrize("job_process", ["fork", "inline"])
def test_a_job_naming_a_foreign_function_fails_by_name_and_runs_nothing(data_dir, redis_url, redis_conn, tmp_path,
                                                                       job_process):
    state = make_run(data_dir, redis_conn, tmp_path, ["after the foreign jobs"])
    marker = tmp_path / "created-by-a-foreign-job"
    q = queue(GENERATE_QUEUE, redis_conn)
    foreign = [q.enqueue_call("os.mkdir", args=(str(marker),), job_id="foreign_mkdir", at_front=True),
               q.enqueue_call("services.trainer.jobs.train", args=({"run": RUN},), job_id="foreign_train",
                              at_front=True)]  # a draftline function, but not one of this queue's
    with OpenAIServer() as server:
        worker = generator(server, redis_url, data_dir, tmp_path, job_process).start()
        try:
            wait_for(lambda: state.counts("generate").done == 1, "the real job done", 60, worker)
            assert worker.alive(), worker.log()
        finally:
            worker.stop(signal.SIGKILL)
    assert not marker.exists()
    for job in foreign:
        assert job_status(redis_conn, job.id) == JobStatus.FAILED
        reason = Job.fetch(job.id, connection=redis_conn, serializer=SERIALIZER).latest_result().exc_string
        assert reason.startswith("ForeignJob: ") and "refused, nothing ran" in reason, reason
        assert GENERATE_FUNC in reason  # names what the queue does run
    assert "Processing os.mkdir" not in worker.full_log() and "foreign_mkdir" in worker.full_log()


def test_a_horse_lost_from_outside_is_a_loss_and_one_that_exits_non_zero_is_a_failure():
    job = Job(id="j", connection=redis.Redis())
    job.timeout, job.started_at = 600, datetime.now(timezone.utc)
    assert horse_loss(job, signal.SIGKILL) == "killed by SIGKILL"  # waitpid's status of a SIGKILLed child
    assert horse_loss(job, None) == "gone, its exit status lost"
    assert horse_loss(job, 1 << 8) is None  # exit(1): the job's own failure
    job.started_at = datetime.now(timezone.utc) - timedelta(seconds=661)  # the worker killed it: overrun
    assert horse_loss(job, signal.SIGKILL) is None


def subscribed_worker(conn: redis.Redis, name: str) -> DraftlineWorker:
    """A worker whose channel thread has read everything Redis sent it (the subscription's confirmation too)
    and waits in its poll: a message published to the channel has reached the handler."""
    worker = DraftlineWorker([queue("unsubscribe-test", conn)], connection=conn, serializer=SERIALIZER, name=name)
    heard: list[dict] = []
    worker.handle_payload = heard.append  # bound by subscribe() as the channel's handler
    worker.subscribe()
    sent, deadline = 0, time.monotonic() + 10
    while time.monotonic() < deadline and (not heard or len(heard) < sent):
        if not heard and conn.publish(worker.pubsub_channel_name, "are you there"):  # 1: the channel has its reader
            sent += 1
        time.sleep(0.05)
    assert heard and len(heard) == sent and worker.pubsub.subscribed  # nothing sent is still on its way
    return worker


def test_a_stopping_worker_lets_its_channel_go_at_once_when_the_channel_thread_reads_the_reply_first(redis_conn):
    # RQ's own order lost this race on a loaded CI machine and the warm shutdown waited out the thread's 60 s
    # poll (rq/rq#1613). The race is made certain here: the main thread stalls after sending UNSUBSCRIBE until
    # the channel's thread has read the reply, as a descheduled main thread does.
    worker = subscribed_worker(redis_conn, "unsubscribe-race")
    pubsub, thread = worker.pubsub, worker.pubsub_thread
    send = pubsub.unsubscribe

    def send_then_stall(*args, **kwargs):
        send(*args, **kwargs)
        deadline = time.monotonic() + 10
        while pubsub.subscribed and time.monotonic() < deadline:
            time.sleep(0.01)

    pubsub.unsubscribe = send_then_stall
    started = time.monotonic()
    worker.unsubscribe()
    assert time.monotonic() - started < 2, "the warm shutdown waited on the channel's thread"
    assert not thread.is_alive() and pubsub.connection is None  # the thread ended and closed the channel
    assert worker.pubsub_thread is None
    worker.unsubscribe()  # a second call (RQ's teardown after ours) has nothing left to do


def test_a_stopping_worker_does_not_wait_long_on_a_channel_redis_cannot_answer(redis_conn, monkeypatch, caplog):
    monkeypatch.setattr(runtime.worker, "UNSUBSCRIBE_WAIT_S", 0.5)
    worker = subscribed_worker(redis_conn, "unsubscribe-silent")
    thread = worker.pubsub_thread
    worker.pubsub.unsubscribe = lambda *a, **k: None  # sent into a partition: no reply ever comes
    started = time.monotonic()
    worker.unsubscribe()
    assert time.monotonic() - started < 2
    assert thread.is_alive() and thread.daemon  # left to end with the process
    assert "did not end within 0.5 s" in caplog.text
