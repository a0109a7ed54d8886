"""Jobs cross Redis as JSON, never pickle: every enqueue path of the project, read back from the raw job
hash in a real Redis (RQ stores ``data`` zlib-compressed; inside is the serializer's output)."""

from __future__ import annotations

import json
import pickle
import zlib

import pytest
from rq.serializers import JSONSerializer

from services.controller.loop.feeder import enqueue_generate
from runtime.sample_queue import enqueue_train
from shared.jobs import (
    EXTRACT_FUNC,
    GENERATE_FUNC,
    TRAIN_FUNC,
    GenerateJob,
    PromptItem,
    extract_job_id,
    generate_job_id,
    train_job_id,
)
from runtime.queues import SERIALIZER, queue
from runtime.sample_queue import enqueue_extract

PICKLE_PROTOCOL_MARK = 0x80  # the first byte of every pickle of protocol 2 or later


def raw_job_data(conn, job_id: str) -> bytes:
    stored = conn.hget(f"rq:job:{job_id}", "data")
    assert stored is not None, f"no job {job_id} in Redis"
    return zlib.decompress(stored)


def assert_json_job(conn, job_id: str, func: str, payload: dict) -> None:
    data = raw_job_data(conn, job_id)
    assert data[0] != PICKLE_PROTOCOL_MARK, f"job {job_id} is pickled"
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(data)
    # JSONSerializer's layout: [function name, instance, args, kwargs].
    assert json.loads(data) == [func, None, [payload], {}]


def test_the_projects_queues_use_rqs_json_serializer(redis_conn):
    assert SERIALIZER is JSONSerializer and queue("q", redis_conn).serializer is JSONSerializer


def test_generate_jobs_are_stored_as_json(redis_conn):
    job = GenerateJob(run="r", items=[PromptItem(sample_id=3, messages=[{"role": "user", "content": "hi"}])])
    assert enqueue_generate(redis_conn, job)
    assert_json_job(redis_conn, generate_job_id("r", 3), GENERATE_FUNC, job.model_dump(mode="json"))


def test_extract_jobs_are_stored_as_json(redis_conn):
    # The generator and the backfill share this one enqueue path.
    assert enqueue_extract(redis_conn, "r", [4, 5, 7], batch=2) == [[4, 5], [7]]
    for first, ids in ((4, [4, 5]), (7, [7])):
        payload = json.loads(raw_job_data(redis_conn, extract_job_id("r", first)))[2][0]
        assert payload["run"] == "r" and payload["sample_ids"] == ids
        assert_json_job(redis_conn, extract_job_id("r", first), EXTRACT_FUNC, payload)


def test_train_jobs_are_stored_as_json(redis_conn):
    assert enqueue_train(redis_conn, "r")
    payload = json.loads(raw_job_data(redis_conn, train_job_id("r")))[2][0]
    assert payload["run"] == "r"
    assert_json_job(redis_conn, train_job_id("r"), TRAIN_FUNC, payload)
