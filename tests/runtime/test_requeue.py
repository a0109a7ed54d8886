"""Jobs put back at the front of their queue (runtime.requeue): a yield is counted neither as a requeue nor as a
retry, however often it comes, where a lost execution is both; a yield whose execution the reaper has taken already
queues nothing. Real Redis, real RQ queues and executions."""

from __future__ import annotations

import redis
from rq.executions import Execution
from rq.job import Job, JobStatus

from runtime.queues import SERIALIZER, queue
from runtime.requeue import MAX_REQUEUES, REQUEUES_META, requeue_lost, requeue_yielded
from shared.jobs import GENERATE_QUEUE, generate_job_id
from tests.runtime.test_worker import RUN, make_run


def taken(conn: redis.Redis, job_id: str) -> tuple[Job, Execution]:
    """The job at the front of the generate queue, taken and started as a worker takes and starts it."""
    q = queue(GENERATE_QUEUE, conn)
    assert conn.lmove(q.key, q.intermediate_queue_key, "LEFT", "RIGHT").decode() == job_id
    job = Job.fetch(job_id, connection=conn, serializer=SERIALIZER)
    with conn.pipeline() as pipe:
        execution = Execution.create(job, 60, pipeline=pipe, worker_name="generator-test-1")
        pipe.execute()
    return job, execution


def test_a_yielded_job_goes_back_to_the_front_counted_neither_as_a_requeue_nor_as_a_retry(data_dir, redis_conn,
                                                                                         tmp_path):
    state = make_run(data_dir, redis_conn, tmp_path, ["yields", "waits its turn"])
    first, second = generate_job_id(RUN, 0), generate_job_id(RUN, 1)
    q = queue(GENERATE_QUEUE, redis_conn)
    for _ in range(MAX_REQUEUES + 2):  # more yields than a lost job's requeues may number
        job, execution = taken(redis_conn, first)
        assert requeue_yielded(job, q, execution, cause="the worker was told to stop")
        assert q.get_job_ids() == [first, second]
        assert redis_conn.llen(q.intermediate_queue_key) == 0
        assert q.started_job_registry.get_job_ids(cleanup=False) == [] and not redis_conn.exists(execution.key)
    job = Job.fetch(first, connection=redis_conn, serializer=SERIALIZER)
    assert job.get_status() == JobStatus.QUEUED and REQUEUES_META not in job.meta
    assert "generate_retried" not in state.meta()

    job, _ = taken(redis_conn, first)  # against a real loss: both counted
    assert requeue_lost(job, q, cause="its work horse was killed")
    assert Job.fetch(first, connection=redis_conn, serializer=SERIALIZER).meta[REQUEUES_META] == 1
    assert float(state.meta()["generate_retried"]) == 1


def test_a_yield_whose_execution_the_reaper_took_already_queues_nothing(data_dir, redis_conn, tmp_path):
    make_run(data_dir, redis_conn, tmp_path, ["yields after the reaper"])
    job_id = generate_job_id(RUN, 0)
    q = queue(GENERATE_QUEUE, redis_conn)
    job, execution = taken(redis_conn, job_id)
    redis_conn.zrem(q.started_job_registry.key, execution.composite_key)  # the reaper's claim
    assert requeue_lost(job, q, cause="its worker's heartbeat stopped")
    assert not requeue_yielded(job, q, execution, cause="the worker was told to stop")
    assert q.get_job_ids() == [job_id]  # once, not twice
