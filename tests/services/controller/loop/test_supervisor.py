"""The supervisor: feeds runs, moves them to extracting, hands a settled run to training exactly once."""

from __future__ import annotations

import threading

from services.controller.runs.submit import submit_run
from services.controller.loop.supervisor import supervise_forever, supervise_once
from shared.jobs import GENERATE_QUEUE, TRAIN_FUNC, TRAIN_QUEUE, TrainJob, train_job_id
from runtime.queues import queue
from shared.runspec import EvalConfig, RunSpec
from runtime.runstate import RunState
from shared.lifecycle import Failure, FailureKind
from shared.settings import ControllerSettings
from tests.services.controller.runs.test_datasets import write_jsonl

RUN = "sup"


def submit(data_dir, conn, tmp_path, rows: list) -> RunState:
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    submit_run(data_dir, conn, RunSpec(dataset=str(dataset), name=RUN, model="m", evaluate=EvalConfig(holdout=1)))
    return RunState(conn, data_dir, RUN)


def ten_rows_one_bad() -> list:
    rows = [{"prompt": f"q{i}"} for i in range(11)]
    rows[4] = "{bad"
    return rows  # ids 0..9 expected (10 is held out); id 4 fails at submission


def fail(state: RunState, stage: str, sample_id: int, kind: str = "error") -> None:
    state.mark_failed(Failure(run=RUN, stage=stage, sample_id=sample_id, error_class="X", message="m", kind=kind))


def test_unsettled_run_is_fed_and_not_trained(data_dir, redis_conn, tmp_path):
    state = submit(data_dir, redis_conn, tmp_path, ten_rows_one_bad())
    supervise_once(ControllerSettings(data=data_dir, generate_batch=4), redis_conn)
    assert queue(GENERATE_QUEUE, redis_conn).count == 3  # 9 valid prompts in batches of 4
    assert queue(TRAIN_QUEUE, redis_conn).count == 0
    assert state.meta()["state"] == "generating"


def test_run_moves_to_extracting_when_generation_is_settled(data_dir, redis_conn, tmp_path):
    state = submit(data_dir, redis_conn, tmp_path, ten_rows_one_bad())
    cfg = ControllerSettings(data=data_dir, generate_batch=4)
    supervise_once(cfg, redis_conn)
    for sample_id in (0, 1, 2, 3, 5, 6, 7, 8):
        state.mark_done("generate", sample_id)
    fail(state, "generate", 9, FailureKind.DROPPED)
    supervise_once(cfg, redis_conn)
    assert state.meta()["state"] == "extracting"
    assert queue(TRAIN_QUEUE, redis_conn).count == 0


def test_settled_run_gets_one_train_job(data_dir, redis_conn, tmp_path):
    state = submit(data_dir, redis_conn, tmp_path, ten_rows_one_bad())
    cfg = ControllerSettings(data=data_dir, generate_batch=4)
    supervise_once(cfg, redis_conn)
    for sample_id in (0, 1, 2, 3, 5, 6, 7, 8):
        state.mark_done("generate", sample_id)
    fail(state, "generate", 9, FailureKind.DROPPED)
    for sample_id in (0, 1, 2, 3, 5, 6):
        state.mark_done("extract", sample_id)
    fail(state, "extract", 7)
    supervise_once(cfg, redis_conn)
    assert queue(TRAIN_QUEUE, redis_conn).count == 0  # sample 8 is still being extracted
    state.mark_done("extract", 8)
    for _ in range(3):
        supervise_once(cfg, redis_conn)
    train = queue(TRAIN_QUEUE, redis_conn)
    assert train.get_job_ids() == [train_job_id(RUN)]
    job = train.fetch_job(train_job_id(RUN))
    assert job.func_name == TRAIN_FUNC
    assert TrainJob.model_validate(job.args[0]).run == RUN
    assert state.meta()["state"] == "training"
    train.pop_job_id()  # the trainer took it; later passes must not enqueue another
    supervise_once(cfg, redis_conn)
    assert train.count == 0


def test_run_where_nothing_was_extracted_fails_instead_of_training(data_dir, redis_conn, tmp_path):
    state = submit(data_dir, redis_conn, tmp_path, [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}])
    fail(state, "generate", 0)
    fail(state, "generate", 1)
    supervise_once(ControllerSettings(data=data_dir), redis_conn)
    meta = state.meta()
    assert meta["state"] == "failed" and "nothing to train on" in meta["error"]
    assert queue(TRAIN_QUEUE, redis_conn).count == 0


def test_one_broken_run_does_not_stop_the_others(data_dir, redis_conn, tmp_path):
    state = submit(data_dir, redis_conn, tmp_path, ten_rows_one_bad())
    broken = RunState(redis_conn, data_dir, "broken")
    broken.register(5, state="generating", feed_offset=0, prompts_bytes=10)  # its prompts.jsonl is missing
    supervise_once(ControllerSettings(data=data_dir, generate_batch=4), redis_conn)
    assert queue(GENERATE_QUEUE, redis_conn).count == 3
    assert state.meta()["fed_until"] == "10"


def test_a_run_redis_knows_but_the_volume_lacks_is_named_once_without_a_traceback(data_dir, redis_conn, tmp_path,
                                                                                   caplog):
    # Another volume's controller shares this Redis: its run is not this controller's to feed, and a traceback a
    # tick would bury every other line of the log.
    state = submit(data_dir, redis_conn, tmp_path, ten_rows_one_bad())
    RunState(redis_conn, data_dir, "elsewhere").register(5, state="generating", feed_offset=0, prompts_bytes=10)
    cfg, absent = ControllerSettings(data=data_dir, generate_batch=4), set()
    with caplog.at_level("WARNING", logger="services.controller.loop.supervisor"):
        for _ in range(3):
            supervise_once(cfg, redis_conn, absent)
    named = [r for r in caplog.records if "elsewhere" in r.getMessage()]
    assert len(named) == 1, [r.getMessage() for r in caplog.records]
    assert "not on this controller's volume" in named[0].getMessage() and named[0].exc_info is None
    assert str(data_dir / "runs") in named[0].getMessage()
    assert RunState(redis_conn, data_dir, "elsewhere").meta()["state"] == "generating"  # its state is left alone
    assert queue(GENERATE_QUEUE, redis_conn).count == 3 and state.meta()["fed_until"] == "10"


def test_supervise_forever_stops_when_asked(data_dir, redis_conn, tmp_path):
    submit(data_dir, redis_conn, tmp_path, ten_rows_one_bad())
    stop = threading.Event()
    thread = threading.Thread(target=supervise_forever,
                              args=(ControllerSettings(data=data_dir, feed_interval_s=0.05, generate_batch=4), redis_conn, stop))
    thread.start()
    try:
        for _ in range(200):
            if queue(GENERATE_QUEUE, redis_conn).count == 3:
                break
            stop.wait(0.05)
        assert queue(GENERATE_QUEUE, redis_conn).count == 3
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()


def test_an_online_run_that_trains_has_its_disk_pause_lifted_once_the_space_is_back(data_dir, redis_conn, tmp_path):
    from runtime.disk import paused_reason, set_paused
    from shared.lifecycle import RunPhase
    from shared.runspec import OnlineConfig

    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}"} for i in range(4)])
    submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name="onl", model="m", evaluate=EvalConfig(holdout=1),
                                             online=OnlineConfig(enabled=True, budget_bytes=1 << 20)))
    RunState(redis_conn, data_dir, "onl").set_phase(RunPhase.TRAINING, train_enqueued_at=1.0)
    # A claim the full volume refused while the trainer asked for states; the volume has room again now.
    set_paused(redis_conn, "onl", "sample 3 needs 4.0 KiB: free space", need=4096)
    supervise_once(ControllerSettings(data=data_dir), redis_conn)
    assert paused_reason(redis_conn, "onl") is None  # its extractions go on
