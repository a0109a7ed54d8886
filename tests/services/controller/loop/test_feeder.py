"""The feeder's sliding window against real RQ queues on the private Redis."""

from __future__ import annotations

import pytest
from services.controller.loop.feeder import backfill_extract, enqueue_generate, feed_finished, feed_run
from services.controller.runs.submit import submit_run
from shared.jobs import (
    EXTRACT_QUEUE,
    GENERATE_FUNC,
    GENERATE_QUEUE,
    GenerateJob,
    PromptItem,
    extract_job_id,
    generate_job_id,
    payload_sample_ids,
)
from runtime.queues import queue
from runtime.sample_queue import enqueue_extract
from shared.runspec import EvalConfig, RunSpec
from runtime.runstate import RunState
from shared.lifecycle import Failure, FailureKind
from shared.settings import ControllerSettings
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.support.queues import extract_batches, queued_extractions


@pytest.fixture()
def run(data_dir, redis_conn, tmp_path):
    """50 rows, rows 10 and 11 malformed, the last 2 valid rows held out: 46 valid prompts to feed."""
    rows = [{"prompt": f"q{i}"} for i in range(50)]
    rows[10], rows[11] = "{bad", {"prompt": ""}
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name="feed", model="m",
                                             evaluate=EvalConfig(holdout=2)))
    return "feed"


def settings(data_dir, **overrides) -> ControllerSettings:
    return ControllerSettings(data=data_dir, **{"generate_batch": 4, "feed_window": 3, "extract_backlog": 100, **overrides})


def drain(conn, n: int) -> list[str]:
    """Take ``n`` jobs off the generate queue, as a worker would."""
    q = queue(GENERATE_QUEUE, conn)
    return [q.pop_job_id() for _ in range(min(n, q.count))]


def test_window_bounds_the_queue_and_jobs_carry_consecutive_prompts(data_dir, redis_conn, run):
    cfg = settings(data_dir)
    assert feed_run(cfg, RunState(redis_conn, cfg.data, run)) == 3
    assert feed_run(cfg, RunState(redis_conn, cfg.data, run)) == 0  # window full: nothing more however often we call
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
        feed_run(cfg, RunState(redis_conn, cfg.data, run))
        assert queue(GENERATE_QUEUE, redis_conn).count <= cfg.feed_window
        seen += drain(redis_conn, 2)
    ids = []
    for job_id in seen:
        ids += [item.sample_id for item in GenerateJob.model_validate(queue(GENERATE_QUEUE, redis_conn).fetch_job(job_id).args[0]).items]
    assert ids == [i for i in range(48) if i not in (10, 11)]  # 46 valid, in order, each once; 48, 49 held out
    assert feed_finished(RunState(redis_conn, data_dir, run).meta())
    assert feed_run(cfg, RunState(redis_conn, cfg.data, run)) == 0


def test_extract_backlog_pauses_generation(data_dir, redis_conn, run):
    cfg = settings(data_dir, extract_backlog=2)
    extract = queue(EXTRACT_QUEUE, redis_conn)
    enqueue_extract(redis_conn, run, [0, 1, 2], batch=2)  # the backlog counts jobs: two
    assert feed_run(cfg, RunState(redis_conn, cfg.data, run)) == 0
    assert queue(GENERATE_QUEUE, redis_conn).count == 0
    extract.pop_job_id()
    assert feed_run(cfg, RunState(redis_conn, cfg.data, run)) == 3


def test_window_counts_only_this_runs_jobs(data_dir, redis_conn, run, tmp_path):
    # "feed_2"'s job ids start with "generate_feed_", yet they are not "feed"'s.
    dataset = write_jsonl(tmp_path / "other.jsonl", [{"prompt": f"o{i}"} for i in range(20)])
    submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name="feed_2", model="m",
                                             evaluate=EvalConfig(holdout=1)))
    cfg = settings(data_dir)
    assert feed_run(cfg, RunState(redis_conn, cfg.data, "feed_2")) == 3
    assert feed_run(cfg, RunState(redis_conn, cfg.data, run)) == 3
    assert queue(GENERATE_QUEUE, redis_conn).count == 6


def test_a_repeated_feed_after_a_lost_cursor_never_duplicates_jobs(data_dir, redis_conn, run):
    cfg = settings(data_dir)
    feed_run(cfg, RunState(redis_conn, cfg.data, run))
    taken = drain(redis_conn, 3)  # a worker holds them now
    RunState(redis_conn, data_dir, run).set_meta(feed_offset=0)  # the controller died before saving its cursor
    assert feed_run(cfg, RunState(redis_conn, cfg.data, run)) == 3
    q = queue(GENERATE_QUEUE, redis_conn)
    assert not set(q.get_job_ids()) & set(taken)
    assert q.get_job_ids() == [generate_job_id(run, 14), generate_job_id(run, 18), generate_job_id(run, 22)]


def test_run_names_with_dots_get_valid_distinct_job_ids(data_dir, redis_conn, tmp_path):
    # RQ accepts only letters, digits, "_" and "-" in job ids; "a.b" and "a_b" must still not collide.
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}"} for i in range(6)])
    for name in ("data.v2", "data_v2"):
        submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name=name, model="m",
                                                 evaluate=EvalConfig(holdout=1)))
        assert feed_run(settings(data_dir), RunState(redis_conn, data_dir, name)) == 2
    ids = queue(GENERATE_QUEUE, redis_conn).get_job_ids()
    assert len(set(ids)) == 4
    assert generate_job_id("data.v2", 4) in ids and generate_job_id("data_v2", 4) in ids


# ---- the feeder as a scanner: settled ids, in-flight ids, the extract backfill, large resumed runs ----


def enqueued_ids(conn, queue_name: str) -> list[int]:
    q = queue(queue_name, conn)
    ids = []
    for job_id in q.get_job_ids():
        ids += payload_sample_ids(q.fetch_job(job_id).args[0])
    return ids


def test_ids_settled_in_generate_are_never_fed(data_dir, redis_conn, run):
    state = RunState(redis_conn, data_dir, run)
    for sample_id in (0, 1, 2, 5):
        state.mark_done("generate", sample_id)
    state.mark_failed(Failure(run=run, stage="generate", sample_id=3, error_class="X", message="m"))
    state.mark_failed(Failure(run=run, stage="generate", sample_id=6, error_class="X", message="m", kind=FailureKind.DROPPED))
    assert feed_run(settings(data_dir), RunState(redis_conn, data_dir, run)) == 3
    assert enqueued_ids(redis_conn, GENERATE_QUEUE) == [4, 7, 8, 9, 12, 13, 14, 15, 16, 17, 18, 19]


def test_a_rescan_skips_the_ids_of_waiting_jobs(data_dir, redis_conn, run):
    assert feed_run(settings(data_dir), RunState(redis_conn, data_dir, run)) == 3  # ids 0-9, 12, 13
    RunState(redis_conn, data_dir, run).set_meta(feed_offset=0)  # a resume resets the cursor
    assert feed_run(settings(data_dir, feed_window=5), RunState(redis_conn, data_dir, run)) == 2
    ids = enqueued_ids(redis_conn, GENERATE_QUEUE)
    assert len(ids) == len(set(ids)) == 20 and ids[-8:] == list(range(14, 22))


def test_backfill_queues_extractions_for_replies_without_one_within_the_backlog(data_dir, redis_conn, run):
    state = RunState(redis_conn, data_dir, run)
    for sample_id in range(10):
        state.mark_done("generate", sample_id)
    for sample_id in (0, 1, 2):
        state.mark_done("extract", sample_id)
    state.mark_failed(Failure(run=run, stage="extract", sample_id=3, error_class="X", message="m"))
    cfg = settings(data_dir, extract_backlog=2, extract_batch=2)
    assert backfill_extract(cfg, RunState(redis_conn, cfg.data, run)) == 4  # two jobs of two samples
    assert backfill_extract(cfg, RunState(redis_conn, cfg.data, run)) == 0  # backlog full
    assert enqueued_ids(redis_conn, EXTRACT_QUEUE) == [4, 5, 6, 7]
    queue(EXTRACT_QUEUE, redis_conn).pop_job_id()
    assert backfill_extract(cfg, RunState(redis_conn, cfg.data, run)) == 2
    assert enqueued_ids(redis_conn, EXTRACT_QUEUE) == [6, 7, 8, 9]
    assert backfill_extract(cfg, RunState(redis_conn, cfg.data, run)) == 0


def test_backfill_never_queues_a_sample_a_waiting_batch_job_or_a_generate_job_in_flight_holds(data_dir, redis_conn,
                                                                                               run):
    state = RunState(redis_conn, data_dir, run)
    for sample_id in range(10):
        state.mark_done("generate", sample_id)
    enqueue_extract(redis_conn, run, [1, 2, 5], batch=16)  # the generator's batch, waiting
    # Replies 8 and 9 are saved, and their generate job, still in flight, queues their extraction as it ends.
    enqueue_generate(redis_conn, GenerateJob(run=run, items=[PromptItem(sample_id=i, messages=[]) for i in (8, 9)]))
    cfg = settings(data_dir, extract_batch=16)
    assert backfill_extract(cfg, RunState(redis_conn, cfg.data, run)) == 5
    assert extract_batches(redis_conn) == {extract_job_id(run, 1): [1, 2, 5], extract_job_id(run, 0): [0, 3, 4, 6, 7]}
    state.set_meta(extract_cursor=0)  # another pass while both jobs still wait
    assert backfill_extract(cfg, RunState(redis_conn, cfg.data, run)) == 0
    assert queued_extractions(redis_conn) == [0, 1, 2, 3, 4, 5, 6, 7]  # each sample once


def test_a_resumed_large_run_never_exceeds_the_windows_and_feeds_each_open_id_once(data_dir, redis_conn, tmp_path):
    from services.controller.loop.reconcile import reconcile_run
    from tests.services.controller.volume import finish_samples, prompt_rows, submit

    state = submit(data_dir, redis_conn, tmp_path, "big", prompt_rows(5001, bad=(4990,)))  # ids 0..4999
    finish_samples(state, generated=range(4900), extracted=range(4800))
    redis_conn.flushall()
    report = reconcile_run(data_dir, redis_conn, "big")
    assert (report.generated, report.extracted, report.failures_kept) == (4900, 4800, 1)
    cfg = settings(data_dir, generate_batch=8, feed_window=3, extract_backlog=40)
    gen_q, ext_q = queue(GENERATE_QUEUE, redis_conn), queue(EXTRACT_QUEUE, redis_conn)
    generated, extracted = [], []
    for _ in range(200):
        feed_run(cfg, RunState(redis_conn, cfg.data, "big"))
        backfill_extract(cfg, RunState(redis_conn, cfg.data, "big"))
        assert gen_q.count <= cfg.feed_window and ext_q.count <= cfg.extract_backlog
        if gen_q.count == ext_q.count == 0:
            break
        for job_id in gen_q.get_job_ids()[:2]:  # workers take a few jobs and finish them
            gen_q.remove(job_id)
            ids = [item["sample_id"] for item in gen_q.fetch_job(job_id).args[0]["items"]]
            for sample_id in ids:
                generated.append(sample_id)
                state.mark_done("generate", sample_id)
            enqueue_extract(redis_conn, "big", ids, batch=cfg.extract_batch)  # as the generator does as a job ends
        for job_id in ext_q.get_job_ids()[:25]:
            ext_q.remove(job_id)
            for sample_id in ext_q.fetch_job(job_id).args[0]["sample_ids"]:
                extracted.append(sample_id)
                state.mark_done("extract", sample_id)
    assert sorted(generated) == [i for i in range(4900, 5000) if i != 4990]
    assert sorted(extracted) == [i for i in range(4800, 5000) if i != 4990]
    assert state.counts("extract").done == 4999
