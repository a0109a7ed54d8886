"""Extract jobs of several samples against a real Redis: batch ids, no sample queued twice, what queued jobs hold."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from rq.job import JobStatus

from shared.jobs import EXTRACT_QUEUE, ExtractJob, extract_job_id, payload_sample_ids
from runtime.queues import SERIALIZER, queue
from runtime.sample_queue import batches, enqueue_extract, held_sample_ids
from tests.services.controller.loop.test_reaper import take


def held(conn, run: str) -> set[int]:
    return held_sample_ids(conn, EXTRACT_QUEUE, extract_job_id(run, 0).rsplit("_", 1)[0])[1]


def test_batches_are_sorted_without_repeats_and_at_most_the_batch_size():
    assert batches([9, 3, 4, 3, 5, 1], 2) == [[1, 3], [4, 5], [9]]
    assert batches([], 4) == []


def test_a_batch_job_is_named_after_its_first_sample_and_holds_each_sample_once(redis_conn):
    assert enqueue_extract(redis_conn, "r", range(5), batch=3) == [[0, 1, 2], [3, 4]]
    assert queue(EXTRACT_QUEUE, redis_conn).get_job_ids() == [extract_job_id("r", 0), extract_job_id("r", 3)]
    assert held(redis_conn, "r") == {0, 1, 2, 3, 4}
    assert enqueue_extract(redis_conn, "r", range(5), batch=3) == []  # every sample already waits


def test_samples_a_waiting_job_does_not_hold_are_queued_under_their_own_first_id(redis_conn):
    enqueue_extract(redis_conn, "r", [0, 1], batch=16)
    assert enqueue_extract(redis_conn, "r", [0, 1, 2, 3], batch=16) == [[2, 3]]
    ids = queue(EXTRACT_QUEUE, redis_conn).get_job_ids()
    assert ids == [extract_job_id("r", 0), extract_job_id("r", 2)]
    assert sorted(i for job in ids for i in queue(EXTRACT_QUEUE, redis_conn).fetch_job(job).args[0]["sample_ids"]) == \
        [0, 1, 2, 3]


def test_a_finished_jobs_id_is_reused_for_its_unsettled_samples(redis_conn):
    q = queue(EXTRACT_QUEUE, redis_conn)
    enqueue_extract(redis_conn, "r", [4, 5], batch=16)
    job = q.fetch_job(extract_job_id("r", 4))
    q.remove(job)
    job.set_status(JobStatus.FINISHED)  # ran, yet its samples are not settled (a retry cleared them, say)
    assert enqueue_extract(redis_conn, "r", [4, 5], batch=16) == [[4, 5]]
    assert q.get_job_ids() == [extract_job_id("r", 4)]


def test_held_ids_include_waiting_taken_and_started_jobs_and_only_this_runs(redis_conn):
    q = queue(EXTRACT_QUEUE, redis_conn)
    enqueue_extract(redis_conn, "r", [7], batch=16)
    take(redis_conn, "w-started", EXTRACT_QUEUE)  # in the started registry
    enqueue_extract(redis_conn, "r", [0, 1], batch=16)
    q.dequeue_any([q], None, connection=redis_conn, serializer=SERIALIZER)  # taken: in RQ's intermediate list
    enqueue_extract(redis_conn, "r", [3], batch=16)  # waiting
    enqueue_extract(redis_conn, "r_b", [2], batch=16)  # another run whose name extends this one's
    assert q.get_job_ids() == [extract_job_id("r", 3), extract_job_id("r_b", 2)]
    assert held(redis_conn, "r") == {0, 1, 3, 7}
    assert held(redis_conn, "r_b") == {2}


def test_an_extract_payload_is_a_strictly_increasing_batch_and_an_old_one_sample_payload_is_a_batch_of_one():
    assert ExtractJob.model_validate({"run": "r", "sample_id": 5}).sample_ids == [5]
    assert ExtractJob(run="r", sample_ids=[1, 4]).model_dump(mode="json")["sample_ids"] == [1, 4]
    for bad in ([], [3, 3], [4, 1], [-1]):
        with pytest.raises(ValidationError):
            ExtractJob(run="r", sample_ids=bad)


def test_payload_sample_ids_reads_generate_extract_and_one_sample_payloads():
    assert payload_sample_ids({"items": [{"sample_id": 3, "messages": []}, {"sample_id": 4}]}) == [3, 4]
    assert payload_sample_ids({"sample_ids": [1, 2]}) == [1, 2]
    assert payload_sample_ids({"sample_id": 9}) == [9]
