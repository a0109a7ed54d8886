"""Rebuilding a run's Redis state from the volume: what counts as done, what is redone, what is named."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from services.controller.loop.reconcile import (
    NO_PROMPTS_BACKOFF_S,
    REBUILD_BACKOFF_S,
    NoPromptList,
    file_identity,
    lost_runs,
    merge_bitmap,
    reconcile_run,
    remove_if_unchanged,
)
from runtime.runstate import RunState, bitmap_ids, known_runs, read_finished
from shared.lifecycle import Failure, FailureKind, Outcome, RunKeys, Stage, StageState
from services.controller.runs.status import run_status
from services.controller.loop.supervisor import supervise_once
from shared.errors import RunNotFound
from shared.jobs import GENERATE_QUEUE, GenerateJob
from shared.manifest import MANIFEST_NAME, read_manifest
from runtime.queues import queue
from shared.settings import ControllerSettings
from tests.services.controller.volume import finish_samples, prompt_rows, submit, write_hidden

RUN = "rec"


@pytest.fixture()
def state(data_dir, redis_conn, tmp_path) -> RunState:
    """20 rows, row 15 malformed, the last 2 held out: ids 0..17 expected, 17 of them prompts."""
    return submit(data_dir, redis_conn, tmp_path, RUN, prompt_rows(20, bad=(15,)), holdout=2)


def fail(state: RunState, stage: str, sample_id: int, kind: str = "error") -> None:
    state.mark_failed(Failure(run=state.run, stage=stage, sample_id=sample_id, error_class="InferenceRejected",
                              message=f"no {sample_id}", kind=kind))


def done_ids(conn, run: str, stage: str) -> list[int]:
    return bitmap_ids(conn.get(RunKeys(run).outcome(stage, Outcome.DONE)))


def test_a_run_redis_lost_is_registered_again_from_the_volume(data_dir, redis_conn, state):
    finish_samples(state, generated=range(0, 10), extracted=range(0, 6))
    fail(state, "generate", 12)
    fail(state, "generate", 13, FailureKind.DROPPED)
    before = state.meta()
    redis_conn.flushall()
    report = reconcile_run(data_dir, redis_conn, RUN)
    assert report.registered and report.expected == 18
    assert (report.generated, report.extracted, report.failures_kept) == (10, 6, 3)
    meta = state.meta()
    for key in ("expected", "train_ids", "holdout", "prompts_bytes", "dataset"):
        assert meta[key] == before[key], key
    assert meta["state"] == "generating" and float(meta["resumed_at"]) == report.resumed_at
    assert (meta["feed_offset"], meta["extract_cursor"]) == ("0", "0")
    assert json.loads(meta["layer_ids"]) == [1, 3, 4]
    assert RUN in known_runs(redis_conn)
    assert done_ids(redis_conn, RUN, "generate") == list(range(10))
    assert done_ids(redis_conn, RUN, "extract") == list(range(6))
    assert [(f.sample_id, f.error_class, f.kind) for f in state.failures()] == [
        (12, "InferenceRejected", "error"), (13, "InferenceRejected", "dropped"), (15, "InvalidJson", "error")]
    status = run_status(data_dir, redis_conn, RUN)
    assert status["stages"]["generate"]["done"] == 10 and status["stages"]["extract"]["done"] == 6
    # The requests that made those ten replies went with Redis: the run's request count is unknown from here on.
    assert meta["generate_requests_uncounted"] == "1" and status["stages"]["generate"]["requests"] is None


def test_a_run_rebuilt_before_any_reply_keeps_counting_its_requests(data_dir, redis_conn, state):
    redis_conn.flushall()
    reconcile_run(data_dir, redis_conn, RUN)
    assert "generate_requests_uncounted" not in state.meta()
    assert run_status(data_dir, redis_conn, RUN)["stages"]["generate"]["requests"] == 0


def test_files_of_ids_outside_the_run_are_not_counted(data_dir, redis_conn, state):
    finish_samples(state, generated=[15, 18, 19], extracted=[15, 18])  # no prompt (15) and held out (18, 19)
    report = reconcile_run(data_dir, redis_conn, RUN)
    assert (report.generated, report.extracted) == (0, 0)


def test_truncated_and_unreadable_files_are_removed_so_they_are_made_again(data_dir, redis_conn, state):
    finish_samples(state, generated=range(0, 8), extracted=range(0, 6))
    truncated, bad_header, flipped = state.paths.hidden(0), state.paths.hidden(1), state.paths.hidden(2)
    truncated.write_bytes(truncated.read_bytes()[:-9])
    raw = bad_header.read_bytes()
    bad_header.write_bytes(raw[:8] + b"!" + raw[9:])
    raw = bytearray(flipped.read_bytes())
    raw[-1] ^= 0x01  # still finite, same size and header: only a checksum notices
    flipped.write_bytes(bytes(raw))
    state.paths.generated(6).write_text('{"sample_id": 6, "messa')
    quick = reconcile_run(data_dir, redis_conn, RUN)
    assert sorted((r["stage"], r["sample_id"]) for r in quick.redone) == [("extract", 0), ("extract", 1), ("generate", 6)]
    assert not truncated.exists() and not bad_header.exists() and flipped.exists()
    assert not state.paths.generated(6).exists()
    assert done_ids(redis_conn, RUN, "extract") == [2, 3, 4, 5]
    assert done_ids(redis_conn, RUN, "generate") == [0, 1, 2, 3, 4, 5, 7]
    deep = reconcile_run(data_dir, redis_conn, RUN, deep=True)
    assert [(r["stage"], r["sample_id"]) for r in deep.redone] == [("extract", 2)]
    assert "checksum" in deep.redone[0]["reason"]
    assert done_ids(redis_conn, RUN, "extract") == [3, 4, 5]


def test_old_temp_files_go_and_fresh_ones_stay(data_dir, redis_conn, state):
    finish_samples(state, generated=[0], extracted=[0])
    old = state.paths.hidden(0).parent / ".tmp-00000001.safetensors.abc"
    fresh = state.paths.hidden(0).parent / ".tmp-00000002.safetensors.def"
    for path in (old, fresh):
        path.write_bytes(b"partial")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    report = reconcile_run(data_dir, redis_conn, RUN)
    assert report.temp_removed == 1 and not old.exists() and fresh.exists()


def test_a_file_without_manifest_entry_is_adopted_when_old_and_left_alone_when_fresh(data_dir, redis_conn, state):
    finish_samples(state, generated=range(0, 4), extracted=[0])
    write_hidden(state.paths, 1)  # written, verified by nobody yet: an extractor may be finishing it
    write_hidden(state.paths, 2)
    broken = state.paths.hidden(3)
    broken.write_bytes(b"\x00" * 40)
    for path in (state.paths.hidden(2), broken):
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    report = reconcile_run(data_dir, redis_conn, RUN)
    assert report.adopted == 1 and [r["sample_id"] for r in report.redone] == [3]
    assert done_ids(redis_conn, RUN, "extract") == [0, 2]
    manifest = read_manifest(state.paths.hidden(0).parent / MANIFEST_NAME)
    assert sorted(manifest) == [0, 2] and manifest[2].bytes == state.paths.hidden(2).stat().st_size
    assert state.paths.hidden(1).exists() and not broken.exists()


def test_a_failure_of_a_sample_that_is_done_is_stale_and_cleared(data_dir, redis_conn, state):
    fail(state, "extract", 5)
    finish_samples(state, generated=[5], extracted=[5])  # a crash hit between mark_done and the record's removal
    report = reconcile_run(data_dir, redis_conn, RUN)
    assert report.failures_cleared == 1
    assert not state.paths.failure("extract", 5).exists()
    assert state.failures("extract") == [] and state.counts("extract").failed == 0


def test_a_row_with_no_prompt_and_no_record_is_named(data_dir, redis_conn, state):
    state.paths.failure("generate", 15).unlink()  # the malformed row's record is lost
    redis_conn.flushall()
    report = reconcile_run(data_dir, redis_conn, RUN)
    assert report.named == [15]
    (failure,) = [f for f in state.failures() if f.sample_id == 15]
    assert failure.error_class == "MissingPromptRow" and "prompts.jsonl" in failure.message
    assert state.paths.failure("generate", 15).is_file()


def test_stale_redis_bits_go_and_bits_backed_by_the_volume_stay(redis_conn):
    key = RunKeys("bits").outcome(Stage.EXTRACT, Outcome.DONE)
    for sample_id in (2, 5, 6):
        redis_conn.setbit(key, sample_id, 1)
    mask = np.zeros(10, dtype=bool)
    mask[[1, 2]] = True
    # 5 was finished by a worker after the scan (the volume backs it now); 6 has nothing behind it.
    merge_bitmap(redis_conn, key, f"{key}:reconcile", mask, still_set=lambda sample_id: sample_id == 5)
    assert bitmap_ids(redis_conn.get(key)) == [1, 2, 5]


def test_a_resume_resets_cursors_and_keeps_a_live_trainers_reports(data_dir, redis_conn, state):
    state.set_meta(feed_offset=123, extract_cursor=7, feed_pass_at=1.0)
    redis_conn.flushall()
    state.set_progress("train", 3, 10)  # a trainer kept reporting into the empty Redis
    reconcile_run(data_dir, redis_conn, RUN)
    meta = state.meta()
    assert (meta["feed_offset"], meta["extract_cursor"]) == ("0", "0") and "feed_pass_at" not in meta
    assert meta["state"] == "training" and "train_enqueued_at" in meta  # no second train job
    assert meta["train_done"] == "3"


def test_a_resume_restores_lost_stages_from_the_evaluation_report(data_dir, redis_conn, state):
    state.paths.eval_report.parent.mkdir(parents=True, exist_ok=True)
    state.paths.eval_report.write_text(json.dumps({"acceptance_length": 2.5}))
    redis_conn.flushall()
    reconcile_run(data_dir, redis_conn, RUN)
    meta = state.meta()
    # The stages the report stands for give the phase, by the lifecycle's rule (the run has failures).
    assert (meta["state"], meta["train_state"], meta["evaluate_state"]) == ("complete_with_failures", "done", "done")
    assert meta["acceptance_length"] == "2.5"
    # A failure the trainer reported after writing the report is later than the report: it stands.
    state.set_stage(Stage.EVALUATE, StageState.FAILED)
    reconcile_run(data_dir, redis_conn, RUN)
    assert state.meta()["evaluate_state"] == "failed"
    assert run_status(data_dir, redis_conn, RUN)["state"] == "failed"


def test_reconcile_of_an_unknown_run_is_named(data_dir, redis_conn):
    with pytest.raises(RunNotFound):
        reconcile_run(data_dir, redis_conn, "nope")


# ---- the supervisor -----------------------------------------------------------------------------


def cfg(data_dir) -> ControllerSettings:
    return ControllerSettings(data=data_dir, generate_batch=4, feed_window=2, extract_backlog=100)


def fed_ids(conn) -> list[int]:
    q = queue(GENERATE_QUEUE, conn)
    return sorted(i.sample_id for job_id in q.get_job_ids() for i in GenerateJob.model_validate(q.fetch_job(job_id).args[0]).items)


def test_supervisor_rebuilds_a_flushed_run_and_feeds_only_what_is_unsettled(data_dir, redis_conn, state):
    finish_samples(state, generated=range(0, 10), extracted=range(0, 10))
    fail(state, "generate", 11)
    redis_conn.flushall()
    assert lost_runs(data_dir, redis_conn) == [RUN]
    supervise_once(cfg(data_dir), redis_conn)
    assert RUN in known_runs(redis_conn)
    assert fed_ids(redis_conn) == [10, 12, 13, 14, 16, 17]  # 2 jobs, skipping done 0-9, failed 11, malformed 15
    assert lost_runs(data_dir, redis_conn) == []


def test_a_finished_run_is_marked_on_the_volume_and_never_rebuilt(data_dir, redis_conn, state):
    finish_samples(state, generated=[i for i in range(18) if i != 15], extracted=[i for i in range(18) if i != 15])
    reconcile_run(data_dir, redis_conn, RUN)
    supervise_once(cfg(data_dir), redis_conn)
    assert state.meta()["state"] == "training"
    for stage in (Stage.TRAIN, Stage.EVALUATE):  # as the trainer's jobs move them
        state.set_stage(stage, StageState.RUNNING)
        state.set_stage(stage, StageState.DONE, acceptance_length=1.5)
    supervise_once(cfg(data_dir), redis_conn)
    record = read_finished(state.paths)
    assert record["state"] == "complete_with_failures"  # row 15 was malformed
    assert record["extract"]["done"] == 17 and record["generate"]["failed"] == 1
    redis_conn.flushall()
    assert lost_runs(data_dir, redis_conn) == []
    supervise_once(cfg(data_dir), redis_conn)
    assert known_runs(redis_conn) == []
    status = run_status(data_dir, redis_conn, RUN)
    assert status["state"] == "complete_with_failures" and status["stages"]["extract"]["done"] == 17
    assert status["stages"]["generate"]["requests"] is None  # the finished record does not hold the count


def test_a_run_being_submitted_is_left_to_its_submitter(data_dir, redis_conn, state):
    redis_conn.flushall()
    redis_conn.set(f"draftline:submit-lock:{RUN}", "1")
    assert lost_runs(data_dir, redis_conn) == []


def test_a_run_that_fails_to_rebuild_is_logged_with_its_traceback_and_left_alone_for_a_minute(
        data_dir, redis_conn, state, caplog):
    with open(state.paths.prompts, "ab") as handle:
        handle.write(b"not a prompt line\n")  # a volume damaged beyond what a resume can repair
    redis_conn.flushall()
    supervise_once(cfg(data_dir), redis_conn)
    failed = [r for r in caplog.records if "run rec: rebuilding failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None  # an unexpected fault keeps its traceback
    assert 0 < redis_conn.ttl(f"draftline:rebuild-backoff:{RUN}") <= REBUILD_BACKOFF_S
    assert lost_runs(data_dir, redis_conn) == []  # backing off instead of failing every tick
    redis_conn.delete(f"draftline:rebuild-backoff:{RUN}")
    assert lost_runs(data_dir, redis_conn) == [RUN]


def test_a_run_without_its_prompt_list_is_named_in_one_line_and_looked_at_again_in_ten_minutes(
        data_dir, redis_conn, state, caplog):
    """A run directory made outside the controller (bench_train_sweep's training-only variants sit beside a
    running stack's runs) or one whose prompts.jsonl was deleted: no samples can be rebuilt, which is a
    condition to name, not a fault to trace back every minute."""
    state.paths.prompts.unlink()
    redis_conn.flushall()
    with pytest.raises(NoPromptList, match="prompts.jsonl is missing"):
        reconcile_run(data_dir, redis_conn, RUN)  # what `draftline resume` prints
    supervise_once(cfg(data_dir), redis_conn)
    named = [r for r in caplog.records if "prompts.jsonl is missing" in r.getMessage()]
    assert len(named) == 1 and named[0].levelname == "WARNING" and named[0].exc_info is None
    assert "run rec:" in named[0].getMessage()
    assert not [r for r in caplog.records if r.levelname == "FailureKind.ERROR"]
    assert REBUILD_BACKOFF_S < redis_conn.ttl(f"draftline:rebuild-backoff:{RUN}") <= NO_PROMPTS_BACKOFF_S
    supervise_once(cfg(data_dir), redis_conn)
    assert len([r for r in caplog.records if "prompts.jsonl is missing" in r.getMessage()]) == 1  # not every pass


def test_a_bad_file_replaced_by_its_writer_during_the_scan_is_not_removed(tmp_path):
    """The scan judges a file bad, then an extractor writes the sample again (temp + rename) before the scan
    removes it: the new file is not the bad one and stays; the judged one would have gone."""
    path = tmp_path / "00000000.safetensors"
    path.write_bytes(b"damaged")
    judged = file_identity(path)
    fresh = tmp_path / ".tmp-00000000"
    fresh.write_bytes(b"written again, whole")
    fresh.replace(path)
    assert not remove_if_unchanged(path, judged) and path.read_bytes() == b"written again, whole"
    assert remove_if_unchanged(path, file_identity(path)) and not path.exists()
    assert not remove_if_unchanged(path, judged)  # gone already: nothing to do
