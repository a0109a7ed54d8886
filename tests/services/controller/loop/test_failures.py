"""Every failure named, and retried on request: generate failures generate again, extract failures extract
again (after generating again when the reply is gone), jobs RQ failed name their samples."""

from __future__ import annotations

import time

import pytest
from rq import SimpleWorker
from rq.job import Job, JobStatus

from services.controller.loop.failures import list_failures, name_failed_jobs, retry_failures
from services.controller.loop.feeder import backfill_extract, feed_run
from services.controller.loop.reconcile import RunBusy
from services.controller.runs.status import run_status
from runtime.runstate import RunState, read_finished, write_finished
from shared.lifecycle import Failure, FailureKind, RunPhase, Stage, StageState
from services.extractor.jobs import run_extract
from shared.jobs import EXTRACT_QUEUE, TRAIN_QUEUE, ExtractJob, evaluate_job_id, extract_job_id, train_job_id
from runtime.queues import SERIALIZER, queue
from shared.runspec import GenerationConfig
from runtime.sample_queue import enqueue_extract
from shared.settings import ControllerSettings, ExtractorSettings
from tests.services.controller.volume import fail_training, finish_samples, prompt_rows, submit
from tests.support.openai_server import OpenAIServer, Reply
from tests.support.processes import ServiceProcess, free_port
from tests.support.queues import queued_extractions

RUN = "retry"


def fail(state: RunState, stage: str, sample_id: int, kind: str = "error", cls: str = "InferenceRejected") -> None:
    state.mark_failed(Failure(run=state.run, stage=stage, sample_id=sample_id, error_class=cls, message="m", kind=kind))


def feed_until(state: RunState, cfg: ControllerSettings, done, worker: ServiceProcess, timeout: float = 60) -> None:
    """What the controller's loop does every tick, until ``done(state)``."""
    deadline = time.monotonic() + timeout
    while not done(state):
        assert time.monotonic() < deadline, worker.log()
        assert worker.alive(), worker.log()
        feed_run(cfg, state)
        backfill_extract(cfg, state)
        time.sleep(0.1)


def generate_settled(state: RunState) -> bool:
    gen = state.counts("generate")
    return gen.done + gen.failed + gen.dropped == state.expected()


def test_retry_generates_failed_samples_again_and_regenerates_a_lost_reply(data_dir, redis_url, redis_conn, tmp_path):
    rows = [{"prompt": f"w{i}"} for i in range(7)]  # 0..5 expected, 6 held out
    state = submit(data_dir, redis_conn, tmp_path, RUN, rows, generation=GenerationConfig(min_completion_tokens=3))
    cfg = ControllerSettings(data=data_dir, generate_batch=2, feed_window=2)
    with OpenAIServer() as server:
        server.set_default(Reply("an answer long enough"))
        server.script("w2", Reply(status=422, error="unsupported role"))
        server.script("w4", Reply("no", completion_tokens=1))
        env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_INFERENCE_URL": server.url}
        with ServiceProcess("generator", env=env, log_dir=tmp_path / "logs") as worker:
            feed_until(state, cfg, generate_settled, worker)
            assert [(f.sample_id, f.error_class, f.kind) for f in list_failures(data_dir, RUN)] == [
                (2, "InferenceRejected", "error"), (4, "ReplyTooShort", "dropped")]
            # An extraction fails because sample 5's reply is gone; retrying it must generate it again.
            state.paths.generated(5).unlink()
            settings = ExtractorSettings(data=data_dir, redis_url=redis_url, model_dir=tmp_path)
            assert run_extract(ExtractJob(run=RUN, sample_ids=[5]), settings, redis_conn, None, None) == ["failed"]
            assert list_failures(data_dir, RUN, stage="extract")[0].error_class == "GeneratedFileError"

            server.script("w2", Reply("now it works fine"))
            report = retry_failures(data_dir, redis_conn, RUN)  # errors only: the drop of 4 stays
            assert sorted((c["stage"], c["sample_id"]) for c in report.cleared) == [("extract", 5), ("generate", 2)]
            assert not state.paths.failure("generate", 2).exists()
            feed_until(state, cfg, lambda s: s.is_done("generate", 2) and s.is_done("generate", 5), worker)
    assert [(f.stage, f.sample_id) for f in list_failures(data_dir, RUN)] == [("generate", 4)]
    assert state.paths.generated(5).is_file() and state.paths.generated(2).is_file()
    assert len(server.requests_for("w2")) == 2 and len(server.requests_for("w5")) == 2
    assert len(server.requests_for("w0")) == 1  # settled samples are never asked for again
    assert 5 in queued_extractions(redis_conn)  # its new reply waits for extraction


def test_drops_are_retried_when_named_and_malformed_rows_never(data_dir, redis_conn, tmp_path):
    state = submit(data_dir, redis_conn, tmp_path, RUN, prompt_rows(8, bad=(1,)))
    fail(state, "generate", 3, FailureKind.DROPPED, "ReplyTooShort")
    fail(state, "generate", 4)
    report = retry_failures(data_dir, redis_conn, RUN, sample_ids=[1, 3, 6])
    assert report.cleared == [{"sample_id": 3, "stage": "generate"}]
    assert [r["sample_id"] for r in report.not_retryable] == [1] and report.unknown == [6]
    assert [f.sample_id for f in list_failures(data_dir, RUN)] == [1, 4]
    assert state.counts("generate").dropped == 0 and state.meta()["feed_offset"] == "0"


def test_a_training_run_refuses_and_a_finished_run_is_reopened(data_dir, redis_conn, tmp_path):
    state = submit(data_dir, redis_conn, tmp_path, RUN, prompt_rows(5))
    finish_samples(state, generated=range(4), extracted=range(3))
    fail(state, "extract", 3)
    state.set_meta(state="training", train_enqueued_at=time.time(), train_state="running")
    with pytest.raises(RunBusy):
        retry_failures(data_dir, redis_conn, RUN)
    state.set_meta(train_state="done", evaluate_state="done", acceptance_length=1.7)
    (state.paths.export_dir).mkdir(parents=True)
    (state.paths.export_dir / "config.json").write_text("{}")
    state.paths.eval_report.write_text("{}")
    write_finished(state, "complete_with_failures")
    report = retry_failures(data_dir, redis_conn, RUN)
    assert report.cleared == [{"sample_id": 3, "stage": "extract"}]
    assert report.superseded
    moved = state.paths.root / "superseded"
    assert [p.name for p in moved.iterdir()] and (next(moved.iterdir()) / "drafter" / "export" / "config.json").is_file()
    assert not state.paths.drafter_dir.exists() and not state.paths.eval_report.exists()
    assert read_finished(state.paths) is None
    meta = state.meta()
    assert meta["state"] == "generating" and meta["train_ids"] == "4"
    assert not {"train_state", "evaluate_state", "train_enqueued_at", "finished_at", "acceptance_length"} & set(meta)


def test_a_job_rq_failed_names_its_samples(data_dir, redis_conn, tmp_path, monkeypatch):
    state = submit(data_dir, redis_conn, tmp_path, RUN, prompt_rows(4))
    finish_samples(state, generated=range(3), extracted=[])
    state.mark_done("extract", 0)
    enqueue_extract(redis_conn, RUN, [0, 1], batch=16)  # one job of both samples
    monkeypatch.delenv("DRAFTLINE_MODEL_DIR", raising=False)  # the job cannot even load its settings
    monkeypatch.setenv("DRAFTLINE_DATA", str(data_dir))
    worker = SimpleWorker([queue(EXTRACT_QUEUE, redis_conn)], connection=redis_conn, serializer=SERIALIZER)
    worker.work(burst=True)
    assert queue(EXTRACT_QUEUE, redis_conn).failed_job_registry.count == 1
    assert name_failed_jobs(data_dir, redis_conn) == 1  # sample 0 was already done
    (failure,) = state.failures("extract")
    assert (failure.sample_id, failure.error_class) == (1, "JobFailed") and "SettingsError" in failure.message
    assert queue(EXTRACT_QUEUE, redis_conn).failed_job_registry.count == 0
    assert enqueue_extract(redis_conn, RUN, [1], batch=16)  # after a retry its job id is free again


def test_a_job_that_lost_redis_is_requeued_not_named(data_dir, redis_conn, tmp_path, monkeypatch, tiny_model_dir):
    state = submit(data_dir, redis_conn, tmp_path, RUN, prompt_rows(2))
    finish_samples(state, generated=range(2), extracted=[])
    enqueue_extract(redis_conn, RUN, [1], batch=16)
    monkeypatch.setenv("DRAFTLINE_DATA", str(data_dir))
    monkeypatch.setenv("DRAFTLINE_MODEL_DIR", str(tiny_model_dir))
    monkeypatch.setenv("REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")  # the job's Redis refuses
    worker = SimpleWorker([queue(EXTRACT_QUEUE, redis_conn)], connection=redis_conn, serializer=SERIALIZER)
    worker.work(burst=True)
    assert queue(EXTRACT_QUEUE, redis_conn).failed_job_registry.count == 1
    assert name_failed_jobs(data_dir, redis_conn) == 0
    assert state.failures() == [] and not state.paths.failure("extract", 1).exists()
    assert queue(EXTRACT_QUEUE, redis_conn).get_job_ids() == [extract_job_id(RUN, 1)]


@pytest.mark.parametrize("redis_lost", [False, True])
def test_retry_queues_a_failed_training_again_from_its_checkpoint(data_dir, redis_conn, tmp_path, redis_lost):
    state = submit(data_dir, redis_conn, tmp_path, RUN, prompt_rows(5))
    fail_training(state, checkpoints=(25, 50))
    assert read_finished(state.paths)["meta"]["train_error"].startswith("OSError")
    if redis_lost:
        redis_conn.flushall()
    shown = run_status(data_dir, redis_conn, RUN)  # read back from the finished record when Redis lost the run
    assert shown["state"] == RunPhase.FAILED and shown["stages"][Stage.TRAIN]["state"] == StageState.FAILED
    assert shown["stages"][Stage.TRAIN]["error"].startswith("OSError: [Errno 28]")
    report = retry_failures(data_dir, redis_conn, RUN)
    assert report.cleared == [] and report.resumed == {"stage": "train", "checkpoint_step": 50}
    meta = state.meta()
    assert meta["state"] == RunPhase.TRAINING and "train_state" not in meta and "train_error" not in meta
    assert read_finished(state.paths) is None and "finished_at" not in meta
    job = Job.fetch(train_job_id(RUN), connection=redis_conn, serializer=SERIALIZER)
    assert job.get_status() == JobStatus.QUEUED and job.origin == TRAIN_QUEUE
    assert run_status(data_dir, redis_conn, RUN)["stages"][Stage.TRAIN]["state"] == "queued"
    # The trainer's start moves the stage to running, as for any train job.
    assert state.set_stage(Stage.TRAIN, StageState.RUNNING) is RunPhase.TRAINING


def test_a_retried_training_with_no_checkpoint_starts_over_and_a_second_retry_while_it_waits_is_refused(
        data_dir, redis_conn, tmp_path):
    state = submit(data_dir, redis_conn, tmp_path, RUN, prompt_rows(5))
    fail_training(state, checkpoints=())
    assert retry_failures(data_dir, redis_conn, RUN).resumed == {"stage": "train", "checkpoint_step": None}
    with pytest.raises(RunBusy):
        retry_failures(data_dir, redis_conn, RUN)


def test_retry_of_a_failed_evaluation_measures_the_export_again(data_dir, redis_conn, tmp_path):
    state = submit(data_dir, redis_conn, tmp_path, RUN, prompt_rows(5))
    finish_samples(state, generated=range(4), extracted=range(4))
    state.set_meta(train_enqueued_at=time.time())
    state.set_stage(Stage.TRAIN, StageState.RUNNING)
    state.set_stage(Stage.TRAIN, StageState.DONE)
    state.set_stage(Stage.EVALUATE, StageState.RUNNING)
    state.set_stage(Stage.EVALUATE, StageState.FAILED, evaluate_error="GreedyMismatch: ...")
    report = retry_failures(data_dir, redis_conn, RUN)
    assert report.resumed == {"stage": "evaluate", "checkpoint_step": None}
    meta = state.meta()
    assert meta["state"] == RunPhase.EVALUATING and meta["train_state"] == StageState.DONE
    assert Job.fetch(evaluate_job_id(RUN), connection=redis_conn, serializer=SERIALIZER).get_status() == JobStatus.QUEUED


def test_a_failed_run_with_nothing_failed_to_resume_is_left_alone(data_dir, redis_conn, tmp_path):
    state = submit(data_dir, redis_conn, tmp_path, RUN, prompt_rows(5))
    state.set_phase(RunPhase.FAILED, error="no sample made it through extraction; nothing to train on")
    report = retry_failures(data_dir, redis_conn, RUN)
    assert report.resumed is None and report.cleared == [] and state.phase() is RunPhase.FAILED
