"""Jobs run inline (``DRAFTLINE_JOB_PROCESS=inline``): no work horse, a heartbeat thread, timeouts that still
end a job by name, and a job that outlives its timeout alarm failing by name and ending its worker."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import redis
from rq.job import Job, JobStatus

from services.controller.loop.reaper import requeue_abandoned
from runtime.inline_jobs import EXIT_OVERRAN, JobHeartbeat, overran_by
from shared.jobs import GENERATE_FUNC, GENERATE_QUEUE, GenerateJob, PromptItem, generate_job_id
from runtime.queues import SERIALIZER, queue
from runtime.worker import DraftlineWorker
from tests.runtime.test_worker import RUN, children_of, generator, job_status, make_run, wait_for
from tests.support.openai_server import OpenAIServer, Reply

REPO = Path(__file__).resolve().parents[2]


def submitted(data_dir: Path, conn: redis.Redis, tmp_path: Path, prompts: list[str]):
    """A run of ``prompts`` (sample ids in order) with nothing queued yet: each test queues its own jobs."""
    state = make_run(data_dir, conn, tmp_path, prompts)
    queue(GENERATE_QUEUE, conn).empty()
    return state


def enqueue(conn: redis.Redis, sample_id: int, prompt: str, timeout: int) -> str:
    item = PromptItem(sample_id=sample_id, messages=[{"role": "user", "content": prompt}])
    job_id = generate_job_id(RUN, sample_id)
    queue(GENERATE_QUEUE, conn).enqueue_call(GENERATE_FUNC, args=(GenerateJob(run=RUN, items=[item]).model_dump(
        mode="json"),), job_id=job_id, timeout=timeout, failure_ttl=3600)
    return job_id


def failure_of(conn: redis.Redis, job_id: str) -> str:
    return Job.fetch(job_id, connection=conn, serializer=SERIALIZER).latest_result().exc_string


def test_an_inline_job_past_its_timeout_fails_by_name_and_the_worker_serves_the_next(
        data_dir, redis_url, redis_conn, tmp_path):
    state = submitted(data_dir, redis_conn, tmp_path, ["hangs", "next"])
    with OpenAIServer() as server:
        server.script("hangs", Reply("never written", delay_s=60))
        server.script("next", Reply("served after the timeout"))
        slow, quick = enqueue(redis_conn, 0, "hangs", timeout=2), enqueue(redis_conn, 1, "next", timeout=60)
        worker = generator(server, redis_url, data_dir, tmp_path, "inline").start()
        try:
            wait_for(lambda: server.requests_for("hangs"), "the hanging request sent", 60, worker)
            assert children_of(worker) == []  # the job runs in the worker itself
            wait_for(lambda: job_status(redis_conn, quick) == JobStatus.FINISHED, "the next job done", 60, worker)
            assert worker.alive(), worker.log()
        finally:
            worker.stop(signal.SIGKILL)
    assert job_status(redis_conn, slow) == JobStatus.FAILED
    assert "JobTimeoutException" in failure_of(redis_conn, slow)
    assert not state.paths.generated(0).exists() and state.paths.generated(1).is_file()
    assert requeue_abandoned(redis_conn) == 0  # settled: nothing left for the reaper


# A worker whose job swallows RQ's timeout alarm (as a per-sample boundary catching Exception may): the
# alarm is replaced by one that never fires, and the grace after the timeout shortened from 60 s to 1 s.
OVERRUN_WORKER = textwrap.dedent("""
    import os, sys
    from shared.jobs import GENERATE_QUEUE
    from runtime.queues import SERIALIZER, connect, queue
    from runtime.worker import DraftlineWorker

    class AlarmSwallowed:
        def __init__(self, timeout, exception=None, **kwargs): pass
        def __enter__(self): return self
        def __exit__(self, *exc): return False

    conn = connect(os.environ["REDIS_URL"])
    worker = DraftlineWorker([queue(GENERATE_QUEUE, conn)], connection=conn, serializer=SERIALIZER,
                             name="overrun-" + str(os.getpid()), job_monitoring_interval=1)
    worker.inline, worker.overrun_grace_s, worker.death_penalty_class = True, 1, AlarmSwallowed
    worker.work(burst=True)
    sys.exit(0)
""")


def test_an_inline_job_that_outlives_its_timeout_alarm_fails_by_name_and_ends_its_worker(
        data_dir, redis_url, redis_conn, tmp_path):
    submitted(data_dir, redis_conn, tmp_path, ["hangs"])
    with OpenAIServer() as server:
        server.script("hangs", Reply("never written", delay_s=120))
        job_id = enqueue(redis_conn, 0, "hangs", timeout=1)
        env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_INFERENCE_URL": server.url,
               "PATH": "/usr/bin:/bin"}
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", OVERRUN_WORKER], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=60)
    assert proc.returncode == EXIT_OVERRAN, proc.stderr
    assert time.monotonic() - started < 30  # ended by the overrun, long before the 120 s reply
    assert job_status(redis_conn, job_id) == JobStatus.FAILED
    reason = failure_of(redis_conn, job_id)
    assert "JobTimeoutException" in reason and "ran it inline and ends itself" in reason, reason
    [name] = [k.decode() for k in redis_conn.keys(DraftlineWorker.redis_worker_namespace_prefix + "overrun-*")]
    assert redis_conn.hget(name, "death") is not None  # its death recorded: no reaper waits on its heartbeat
    assert requeue_abandoned(redis_conn) == 0  # failed, not lost: nothing to requeue


def test_the_heartbeat_beats_while_the_job_runs_and_calls_the_overrun_once_it_is_late():
    job = Job(id="j", connection=redis.Redis())
    job.timeout, job.started_at = 600, datetime.now(timezone.utc)
    beats, overruns = [], []
    with JobHeartbeat(job, 0.05, beat=lambda: beats.append(1), overrun=lambda: overruns.append(1)):
        time.sleep(0.5)
    assert len(beats) >= 3 and overruns == []
    count = len(beats)
    time.sleep(0.2)
    assert len(beats) == count  # stopped with the job

    job.started_at = datetime.now(timezone.utc) - timedelta(seconds=600 + 61)
    assert overran_by(job) is not None
    done = threading.Event()
    with JobHeartbeat(job, 0.05, beat=lambda: beats.append(1), overrun=lambda: (overruns.append(1), done.set())):
        assert done.wait(5)
    assert overruns == [1]  # once: the heartbeat ends with the overrun
    job.timeout = -1
    assert overran_by(job) is None  # no timeout, no overrun
