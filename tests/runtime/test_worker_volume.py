"""A real ``draftline serve generator`` on the wrong volume takes no job: it refuses at start-up, and a
worker whose volume stops matching hands the job it just took back untouched."""

from __future__ import annotations

import signal

from rq.job import JobStatus

from shared.jobs import GENERATE_QUEUE, generate_job_id
from runtime.queues import queue
from runtime.volume import VOLUME_KEY, claim_volume
from tests.runtime.test_worker import RUN, generator, job_status, make_run, wait_for
from tests.support.openai_server import OpenAIServer

PROMPTS = ["one", "two", "three"]


def queued_ids(conn) -> list[str]:
    return queue(GENERATE_QUEUE, conn).get_job_ids()


def test_worker_on_another_directory_refuses_to_start_and_takes_no_job(data_dir, redis_url, redis_conn, tmp_path):
    claim_volume(data_dir, redis_conn)
    state = make_run(data_dir, redis_conn, tmp_path, PROMPTS)
    before = queued_ids(redis_conn)
    local = tmp_path / "local-disk"
    local.mkdir()
    with OpenAIServer() as server:
        worker = generator(server, redis_url, local, tmp_path).start()
        try:
            assert worker.proc.wait(60) == 2, worker.log()
        finally:
            worker.stop(signal.SIGKILL)
        assert server.requests == []
    log = worker.full_log()
    assert "VolumeMismatch" in log and str(local) in log and "has no volume.json" in log
    assert queued_ids(redis_conn) == before == [generate_job_id(RUN, i) for i in range(len(PROMPTS))]
    assert list(local.iterdir()) == []
    assert state.counts("generate").done == 0


def test_worker_hands_a_taken_job_back_when_the_volume_stops_matching(data_dir, redis_url, redis_conn, tmp_path):
    claim_volume(data_dir, redis_conn)
    with OpenAIServer() as server:
        worker = generator(server, redis_url, data_dir, tmp_path).start()
        try:
            wait_for(lambda: "serving" in worker.full_log(), "worker serving", 60, worker)
            # A controller on another volume records its id while this worker waits for jobs.
            redis_conn.set(VOLUME_KEY, "0123456789abcdef")
            state = make_run(data_dir, redis_conn, tmp_path, PROMPTS)
            assert worker.proc.wait(60) == 2, worker.log()
        finally:
            worker.stop(signal.SIGKILL)
        assert server.requests == []
    log = worker.full_log()
    assert "handed back untouched" in log and "0123456789abcdef" in log
    ids = [generate_job_id(RUN, i) for i in range(len(PROMPTS))]
    assert queued_ids(redis_conn) == ids  # the taken job is back at the front, the order unchanged
    assert all(job_status(redis_conn, job_id) == JobStatus.QUEUED for job_id in ids)
    assert redis_conn.llen(queue(GENERATE_QUEUE, redis_conn).intermediate_queue_key) == 0
    assert state.counts("generate").done == 0
    assert not state.paths.generated(0).exists()
