"""Real ``draftline serve generator`` workers stop cleanly: SIGTERM finishes the job, a second one stops now."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import redis
from rq.job import Job, JobStatus

from services.controller.reaper import requeue_abandoned
from services.controller.submit import submit_run
from shared.jobs import (
    GENERATE_FUNC,
    GENERATE_QUEUE,
    GenerateJob,
    PromptItem,
    generate_job_id,
)
from shared.queues import SERIALIZER, queue
from shared.runspec import EvalConfig, GenerationConfig
from shared.runstate import RunState
from tests.services.controller.test_datasets import write_jsonl
from tests.support.openai_server import OpenAIServer, Reply
from tests.support.processes import ServiceProcess

RUN = "stopping"


def make_run(data_dir: Path, conn: redis.Redis, tmp_path: Path, prompts: list[str], run: str = RUN) -> RunState:
    """A submitted run with one generate job per prompt on the queue (sample ids in prompt order)."""
    dataset = write_jsonl(tmp_path / f"{run}.jsonl", [{"prompt": p} for p in prompts] + [{"prompt": "held out"}])
    submit_run(data_dir, conn, dataset=str(dataset), name=run, model="m",
               generation=GenerationConfig(min_completion_tokens=1), evaluate=EvalConfig(holdout=1))
    state = RunState(conn, data_dir, run)
    for line in state.paths.prompts.read_text().splitlines():
        item = PromptItem(**json.loads(line))
        queue(GENERATE_QUEUE, conn).enqueue_call(
            GENERATE_FUNC, args=(GenerateJob(run=run, items=[item]).model_dump(mode="json"),),
            job_id=generate_job_id(run, item.sample_id), timeout=600, result_ttl=3600, failure_ttl=3600,
        )
    return state


def generator(server: OpenAIServer, redis_url: str, data_dir: Path, tmp_path: Path) -> ServiceProcess:
    env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_INFERENCE_URL": server.url}
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


def horse_of(worker: ServiceProcess) -> int:
    """The pid of the worker's work horse (its one child process)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(worker.proc.pid)], capture_output=True, text=True,
                         check=True)
    pids = [int(p) for p in out.stdout.split()]
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


def test_first_sigterm_finishes_the_current_job_then_exits_zero(data_dir, redis_url, redis_conn, tmp_path):
    state = make_run(data_dir, redis_conn, tmp_path, ["slow"])
    job_id = generate_job_id(RUN, 0)
    with OpenAIServer() as server:
        server.script("slow", Reply("finished despite the signal", delay_s=3))
        worker = generator(server, redis_url, data_dir, tmp_path).start()
        try:
            wait_started(redis_conn, job_id, worker)
            worker.proc.send_signal(signal.SIGTERM)
            assert worker.proc.wait(60) == 0, worker.log()
        finally:
            worker.stop(signal.SIGKILL)
    assert job_status(redis_conn, job_id) == JobStatus.FINISHED
    assert json.loads(state.paths.generated(0).read_text())["reply"]["content"] == "finished despite the signal"
    assert state.counts("generate").done == 1
    assert "warm shut down requested" in worker.log()


def test_second_sigterm_stops_at_once_and_the_job_is_not_done(data_dir, redis_url, redis_conn, tmp_path):
    state = make_run(data_dir, redis_conn, tmp_path, ["very slow"])
    job_id = generate_job_id(RUN, 0)
    with OpenAIServer() as server:
        server.script("very slow", Reply("never written", delay_s=120))
        worker = generator(server, redis_url, data_dir, tmp_path).start()
        try:
            wait_started(redis_conn, job_id, worker)
            horse = horse_of(worker)
            worker.proc.send_signal(signal.SIGTERM)
            time.sleep(1.5)  # RQ ignores a second signal within a second of the first (a pool's duplicate)
            worker.proc.send_signal(signal.SIGTERM)
            worker.proc.wait(30)  # far less than the 120 s reply: the job was cut short
        finally:
            worker.stop(signal.SIGKILL)
        assert "cold shut down" in worker.log()
        wait_for(lambda: gone(horse), "work horse gone", 10)
    assert job_status(redis_conn, job_id) == JobStatus.STARTED  # never marked done ...
    assert not state.paths.generated(0).exists()
    assert state.counts("generate").done == 0
    assert requeue_abandoned(redis_conn) == 1  # ... but left for the reaper: the worker recorded its death
    assert job_status(redis_conn, job_id) == JobStatus.QUEUED
