"""The feeder's sliding window against real RQ queues on the private Redis."""

from __future__ import annotations

import pytest

from services.controller.feeder import feed_finished, feed_run
from services.controller.submit import submit_run
from shared.jobs import (
    EXTRACT_FUNC,
    EXTRACT_QUEUE,
    GENERATE_FUNC,
    GENERATE_QUEUE,
    ExtractJob,
    GenerateJob,
    extract_job_id,
    generate_job_id,
)
from shared.queues import queue
from shared.runspec import EvalConfig
from shared.runstate import RunState
from shared.settings import ControllerSettings
from tests.services.controller.test_datasets import write_jsonl


@pytest.fixture()
def run(data_dir, redis_conn, tmp_path):
    """50 rows, rows 10 and 11 malformed, the last 2 valid rows held out: 46 valid prompts to feed."""
    rows = [{"prompt": f"q{i}"} for i in range(50)]
    rows[10], rows[11] = "{bad", {"prompt": ""}
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    submit_run(data_dir, redis_conn, dataset=str(dataset), name="feed", model="m", evaluate=EvalConfig(holdout=2))
    return "feed"


def settings(data_dir, **overrides) -> ControllerSettings:
    return ControllerSettings(data=data_dir, **{"generate_batch": 4, "feed_window": 3, "extract_backlog": 100, **overrides})


def drain(conn, n: int) -> list[str]:
    """Take ``n`` jobs off the generate queue, as a worker would."""
    q = queue(GENERATE_QUEUE, conn)
    return [q.pop_job_id() for _ in range(min(n, q.count))]


def test_window_bounds_the_queue_and_jobs_carry_consecutive_prompts(data_dir, redis_conn, run):
    cfg = settings(data_dir)
    assert feed_run(cfg, redis_conn, run) == 3
    assert feed_run(cfg, redis_conn, run) == 0  # window full: nothing more however often we call
    q = queue(GENERATE_QUEUE, redis_conn)
    assert q.get_job_ids() == [generate_job_id(run, 0), generate_job_id(run, 4), generate_job_id(run, 8)]
    job = q.fetch_job(generate_job_id(run, 8))
    assert job.func_name == GENERATE_FUNC
    payload = GenerateJob.model_validate(job.args[0])
    # Ids 10 and 11 are malformed, so the third batch skips them: consecutive *valid* rows.
    assert [item.sample_id for item in payload.items] == [8, 9, 12, 13]
    assert payload.items[0].messages == [{"role": "user", "content": "q8"}]
    assert job.timeout > 180  # RQ's default would kill long generations


def test_feeding_continues_as_the_queue_drains_until_every_prompt_is_fed_once(data_dir, redis_conn, run):
    cfg = settings(data_dir)
    seen: list[str] = []
    for _ in range(30):
        feed_run(cfg, redis_conn, run)
        assert queue(GENERATE_QUEUE, redis_conn).count <= cfg.feed_window
        seen += drain(redis_conn, 2)
    ids = []
    for job_id in seen:
        ids += [item.sample_id for item in GenerateJob.model_validate(queue(GENERATE_QUEUE, redis_conn).fetch_job(job_id).args[0]).items]
    assert ids == [i for i in range(48) if i not in (10, 11)]  # 46 valid, in order, each once; 48, 49 held out
    assert feed_finished(RunState(redis_conn, data_dir, run).meta())
    assert feed_run(cfg, redis_conn, run) == 0


def test_extract_backlog_pauses_generation(data_dir, redis_conn, run):
    cfg = settings(data_dir, extract_backlog=2)
    extract = queue(EXTRACT_QUEUE, redis_conn)
    for sample_id in (0, 1):
        extract.enqueue_call(EXTRACT_FUNC, args=(ExtractJob(run=run, sample_id=sample_id).model_dump(mode="json"),),
                             job_id=extract_job_id(run, sample_id))
    assert feed_run(cfg, redis_conn, run) == 0
    assert queue(GENERATE_QUEUE, redis_conn).count == 0
    extract.pop_job_id()
    assert feed_run(cfg, redis_conn, run) == 3


def test_window_counts_only_this_runs_jobs(data_dir, redis_conn, run, tmp_path):
    # "feed_2"'s job ids start with "generate_feed_", yet they are not "feed"'s.
    dataset = write_jsonl(tmp_path / "other.jsonl", [{"prompt": f"o{i}"} for i in range(20)])
    submit_run(data_dir, redis_conn, dataset=str(dataset), name="feed_2", model="m", evaluate=EvalConfig(holdout=1))
    cfg = settings(data_dir)
    assert feed_run(cfg, redis_conn, "feed_2") == 3
    assert feed_run(cfg, redis_conn, run) == 3
    assert queue(GENERATE_QUEUE, redis_conn).count == 6


def test_a_repeated_feed_after_a_lost_cursor_never_duplicates_jobs(data_dir, redis_conn, run):
    cfg = settings(data_dir)
    feed_run(cfg, redis_conn, run)
    taken = drain(redis_conn, 3)  # a worker holds them now
    RunState(redis_conn, data_dir, run).set_meta(feed_offset=0)  # the controller died before saving its cursor
    assert feed_run(cfg, redis_conn, run) == 3
    q = queue(GENERATE_QUEUE, redis_conn)
    assert not set(q.get_job_ids()) & set(taken)
    assert q.get_job_ids() == [generate_job_id(run, 14), generate_job_id(run, 18), generate_job_id(run, 22)]


def test_run_names_with_dots_get_valid_distinct_job_ids(data_dir, redis_conn, tmp_path):
    # RQ accepts only letters, digits, "_" and "-" in job ids; "a.b" and "a_b" must still not collide.
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}"} for i in range(6)])
    for name in ("data.v2", "data_v2"):
        submit_run(data_dir, redis_conn, dataset=str(dataset), name=name, model="m", evaluate=EvalConfig(holdout=1))
        assert feed_run(settings(data_dir), redis_conn, name) == 2
    ids = queue(GENERATE_QUEUE, redis_conn).get_job_ids()
    assert len(set(ids)) == 4
    assert generate_job_id("data.v2", 4) in ids and generate_job_id("data_v2", 4) in ids
