"""Run status: every field, the numbers behind them, the stored phase, and the operator text."""

from __future__ import annotations

import json
import re
import time

import pytest

from services.controller.runs.status import first_failures, format_status, list_status, run_status
from services.controller.runs.submit import submit_run
from runtime.disk import HOLD_STALE_S, StageHold, clear_paused, held_field, release_stages, set_paused
from services.trainer.jobs import MIN_USEFUL_LOSS_TOKENS, too_small_warning
from shared.errors import RunNotFound
from shared.runspec import EvalConfig, RunSpec
from runtime.runstate import RunState
from shared.lifecycle import Failure, FailureKind, RunKeys, RunPhase, Stage, StageState
from tests.services.controller.runs.test_datasets import write_jsonl

RUN = "stat"
STAGE_KEYS = {"total", "done", "failed", "dropped", "remaining", "percent", "samples_per_second",
              "rate_window_seconds", "eta_seconds", "paused"}
T0 = 1_700_000_002.5
BURST, EVERY = 50, 10.0  # a true rate of 5 samples/s, landing in bursts


def fail(state: RunState, stage: str, sample_id: int, cls: str = "InferenceRejected", kind: str = "error") -> None:
    state.mark_failed(Failure(run=state.run, stage=stage, sample_id=sample_id, error_class=cls,
                              message=f"{cls} on {sample_id}", kind=kind))


@pytest.fixture()
def state(data_dir, redis_conn, tmp_path) -> RunState:
    """12 rows, row 2 malformed, rows 10-11 held out; generation settled, extraction under way."""
    rows = [{"prompt": f"q{i}"} for i in range(12)]
    rows[2] = "{bad"
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name=RUN, model="m", evaluate=EvalConfig(holdout=2)))
    state = RunState(redis_conn, data_dir, RUN)
    for sample_id in (0, 1, 3, 4, 5, 6, 7):
        state.mark_done("generate", sample_id)
    fail(state, "generate", 8)
    fail(state, "generate", 9, "ReplyTooShort", FailureKind.DROPPED)
    for sample_id in (0, 1, 3):
        state.mark_done("extract", sample_id)
        state.incr("hidden_bytes", 1000)
    fail(state, "extract", 4, "HiddenStateFileError")
    return state


def test_status_has_exactly_the_documented_keys(data_dir, redis_conn, state):
    status = run_status(data_dir, redis_conn, RUN)
    assert set(status) == {"run", "state", "expected", "stages", "errors", "failures", "disk", "eta_seconds",
                           "paused", "drafter", "updated_at", "online"}
    assert status["online"] is None  # an offline run
    assert set(status["stages"]) == {"generate", "extract", "train", "evaluate"}
    assert set(status["stages"]["generate"]) == STAGE_KEYS | {"requests", "requests_per_sample"}
    assert set(status["stages"]["extract"]) == STAGE_KEYS
    assert set(status["stages"]["train"]) == {"total", "done", "percent", "state", "error", "loss", "padding", "validation",
                                              "paused"}
    assert set(status["stages"]["evaluate"]) == {"total", "done", "percent", "state", "error", "paused", "acceptance_length",
                                                 "engine_acceptance_length", "engine_prompts", "engine_error", "k",
                                                 "lookup_acceptance_length", "over_lookup"}
    assert set(status["errors"]) == {"total", "since_resume", "dropped"}
    assert set(status["disk"]) == {"path", "used_bytes", "free_bytes", "total_bytes", "run_bytes", "paused", "holds", "held", "reason",
                                   "paused_at", "projected_bytes", "bytes_per_token", "checked_at",
                                   "checked_free_bytes", "reserve_bytes"}
    assert set(status["drafter"]) == {"export_path", "acceptance_length", "warning"}
    assert all(set(f) == {"sample_id", "stage", "error_class", "message", "kind"} for f in status["failures"])


def test_an_online_run_shows_its_spool_against_the_budget_and_who_waits(data_dir, redis_conn, tmp_path):
    from runtime import spool
    from runtime.disk import landed_counts
    from shared.runspec import OnlineConfig

    dataset = write_jsonl(tmp_path / "online.jsonl", [{"prompt": f"p{i}"} for i in range(6)])
    submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name="onl", model="m", evaluate=EvalConfig(holdout=1),
                                             online=OnlineConfig(enabled=True, budget_bytes=4 << 20)))
    state = RunState(redis_conn, data_dir, "onl")
    for sample_id in (0, 1):
        state.mark_done(Stage.EXTRACT, sample_id, landed=landed_counts(1 << 20, 500))
    state.set_meta(**{spool.ONLINE_EPOCH: 1, spool.ONLINE_EPOCH_TRAINED: 3, spool.ONLINE_EPOCH_SAMPLES: 5,
                      spool.ONLINE_TRAIN_S: 100, spool.ONLINE_WAIT_S: 75, spool.ONLINE_BLOCKED_S: 2.5,
                      spool.ONLINE_EXTRACT_S: 7.5,
                      spool.ONLINE_RELEASED: 7, spool.ONLINE_EVICTED: 2, spool.ONLINE_PEAK_BYTES: 3 << 20,
                      spool.ONLINE_HEAD: 4, spool.ONLINE_WINDOW_FILES: 12, spool.ONLINE_WINDOW_STEPS: 3,
                      spool.ONLINE_WINDOW_BYTES: 3 << 20, spool.ONLINE_WINDOW_LIMIT: "rates"})
    status = run_status(data_dir, redis_conn, "onl")
    assert status["online"] == {"budget_bytes": 4 << 20, "waiting_for": 4, "spool_bytes": 2 << 20, "spool_files": 2,
                                "peak_bytes": 3 << 20, "epoch": 1, "epoch_trained": 3, "epoch_samples": 5,
                                "released": 7, "evicted": 2, "window_files": 12, "window_steps": 3,
                                "window_bytes": 3 << 20, "window_limit": "rates",
                                "train_wait_fraction": 0.75, "extract_blocked_s": 2.5,
                                "extract_blocked_fraction": 0.25, "bottleneck": "extraction"}
    assert status["stages"]["extract"]["eta_seconds"] is None  # extraction follows the trainer: no ETA of its own
    text = format_status(status)
    assert ("online    spool 2.0 MiB of its 4.0 MiB budget (2 files, peak 3.0 MiB, 7 deleted after their steps, 2 unread to make room); "
            "epoch 1: 3 of 5 samples trained; the trainer waited 75% of its time for files, extractions blocked 25% of "
            "their time, 2s on the budget (extraction is the bottleneck); window 12 files, 3 steps ahead, 3.0 MiB "
            "(bounded by the measured rates); waiting for sample 4") in text, text


def test_stage_numbers(data_dir, redis_conn, state):
    status = run_status(data_dir, redis_conn, RUN)
    assert (status["run"], status["state"], status["expected"]) == (RUN, "generating", 10)
    gen, ext = status["stages"]["generate"], status["stages"]["extract"]
    assert (gen["total"], gen["done"], gen["failed"], gen["dropped"], gen["remaining"], gen["percent"]) == (10, 7, 2, 1, 0, 100.0)
    assert gen["eta_seconds"] == 0
    # Extraction only sees what generation produced: 10 - 2 failed - 1 dropped.
    assert (ext["total"], ext["done"], ext["failed"], ext["dropped"], ext["remaining"], ext["percent"]) == (7, 3, 1, 0, 3, 57.1)
    # Four samples settled moments ago are a burst, not a rate: unknown, and so is the run's ETA.
    assert (ext["samples_per_second"], ext["eta_seconds"], status["eta_seconds"]) == (None, None, None)
    assert ext["rate_window_seconds"] < 30
    # Row 2 was named at submission, which is no work generation did: 7 done + 1 failed + 1 dropped settled.
    assert state.throughput("generate").settled == 9
    assert status["errors"] == {"total": 3, "since_resume": 3, "dropped": 1}
    assert status["disk"]["run_bytes"] == 3000
    assert status["disk"]["path"] == str(data_dir)
    assert 0 < status["disk"]["free_bytes"] <= status["disk"]["total_bytes"]
    assert status["stages"]["train"] == {"total": 0, "done": 0, "percent": 0.0, "state": "pending", "error": None,
                                         "loss": None, "padding": None, "validation": {}, "paused": False}
    assert status["drafter"] == {"export_path": None, "acceptance_length": None, "warning": None}


def test_failures_are_listed_generate_first_then_by_sample_id(data_dir, redis_conn, state):
    failures = run_status(data_dir, redis_conn, RUN)["failures"]
    assert [(f["stage"], f["sample_id"], f["error_class"], f["kind"]) for f in failures] == [
        ("generate", 2, "InvalidJson", "error"),
        ("generate", 8, "InferenceRejected", "error"),
        ("generate", 9, "ReplyTooShort", "dropped"),
        ("extract", 4, "HiddenStateFileError", "error"),
    ]
    assert "line 3" in failures[0]["message"]


def test_at_most_50_failures_are_shown(data_dir, redis_conn, state):
    for sample_id in range(100, 160):
        fail(state, "extract", sample_id)
    shown = first_failures(redis_conn, RUN)
    assert len(shown) == 50
    assert [f["sample_id"] for f in shown[:4]] == [2, 8, 9, 4]
    assert shown[-1]["sample_id"] == 145


def test_errors_since_resume_count_only_later_failures(data_dir, redis_conn, state):
    state.set_meta(resumed_at=time.time())
    time.sleep(0.01)
    fail(state, "extract", 5)
    fail(state, "extract", 6, "ReplyTooShort", FailureKind.DROPPED)
    errors = run_status(data_dir, redis_conn, RUN)["errors"]
    assert errors == {"total": 4, "since_resume": 1, "dropped": 2}


def test_trainer_progress_and_drafter_show_up(data_dir, redis_conn, state):
    state.set_progress("train", 5, 20, loss=1.25, epoch_padding=0.025)
    state.set_stage(Stage.TRAIN, StageState.RUNNING)
    status = run_status(data_dir, redis_conn, RUN)
    assert status["state"] == "training"
    assert status["stages"]["train"] == {"total": 20, "done": 5, "percent": 25.0, "state": "running", "error": None,
                                         "loss": 1.25, "padding": 0.025, "validation": {}, "paused": False}
    assert "padding 2.5%" in format_status(status) and "held-out" not in format_status(status)
    # Held-out files (train.validation_files): the curve the trainer's progress report writes, in k order.
    state.set_progress("train", 8, 20, **{f"val_accept{k}": 1 + k / 10 for k in (10, 1, 2, 3)})
    status = run_status(data_dir, redis_conn, RUN)
    assert status["stages"]["train"]["validation"] == {"1": 1.1, "2": 1.2, "3": 1.3, "10": 2.0}
    assert "held-out k=1 1.10 k=3 1.30 k=10 2.00" in format_status(status)
    state.set_progress("evaluate", 4, 4)
    state.set_stage(Stage.TRAIN, StageState.DONE, export_path="/x/export")
    state.set_stage(Stage.EVALUATE, StageState.RUNNING)
    state.set_stage(Stage.EVALUATE, StageState.DONE, acceptance_length=2.5)
    status = run_status(data_dir, redis_conn, RUN)
    assert status["state"] == "complete_with_failures"
    assert status["stages"]["evaluate"]["acceptance_length"] == 2.5
    assert (status["stages"]["evaluate"]["over_lookup"], status["stages"]["evaluate"]["lookup_acceptance_length"]) == \
        (None, None)
    assert "acceptance length 2.50\n" in format_status(status) + "\n"  # no baseline measured: none claimed
    # The baseline it must beat beside it, and how sure the margin is over the prompts measured (the evaluate job's
    # lookup_meta writes these fields).
    state.set_meta(evaluate_k=3, evaluate_lookup_acceptance=1.39, evaluate_over_lookup=1.11,
                   evaluate_over_lookup_low=1.02, evaluate_over_lookup_high=1.2, evaluate_over_lookup_prompts=252,
                   evaluate_over_lookup_level=0.95)
    status = run_status(data_dir, redis_conn, RUN)
    assert status["stages"]["evaluate"]["over_lookup"] == {"difference": 1.11, "low": 1.02, "high": 1.2, "prompts": 252,
                                                           "level": 0.95}
    assert (status["stages"]["evaluate"]["k"], status["stages"]["evaluate"]["lookup_acceptance_length"]) == (3, 1.39)
    assert ("acceptance length 2.50 at k=3, prompt lookup 1.39: +1.11 (95% +1.02 to +1.20 over 252 prompts)"
            in format_status(status))
    # Too few prompts for an interval: the evaluate job writes its bounds empty, and the text says why there is none.
    state.set_meta(evaluate_over_lookup_low="", evaluate_over_lookup_high="", evaluate_over_lookup_prompts=4)
    status = run_status(data_dir, redis_conn, RUN)
    assert status["stages"]["evaluate"]["over_lookup"]["low"] is None
    assert "prompt lookup 1.39: +1.11 (4 prompts: too few for an interval)" in format_status(status)
    assert status["drafter"] == {"export_path": "/x/export", "acceptance_length": 2.5, "warning": None}


def test_a_drafter_trained_on_too_little_data_says_so(data_dir, redis_conn, state):
    warning = too_small_warning(4_321)
    assert "4,321 reply tokens" in warning and too_small_warning(MIN_USEFUL_LOSS_TOKENS) == ""
    state.set_meta(train_state="done", export_path="/x/export", train_warning=warning)
    status = run_status(data_dir, redis_conn, RUN)
    assert status["drafter"]["warning"] == warning
    assert f"  warning   {warning}" in format_status(status)


def test_a_failed_train_job_shows_its_named_error_in_the_status_and_its_text(data_dir, redis_conn, state):
    error = "BaseCheckpointMismatch: base checkpoint /v/b does not fit the target: vocab_size is 800, the target's vocab_size is 774"
    state.set_stage(Stage.TRAIN, StageState.FAILED, train_error=error)
    status = run_status(data_dir, redis_conn, RUN)
    assert status["state"] == "failed" and status["stages"]["train"]["error"] == error
    assert status["stages"]["evaluate"]["error"] is None
    assert re.search(r"train +0 / 0 +0\.0% +failed\n +BaseCheckpointMismatch: base checkpoint /v/b ", format_status(status))


@pytest.mark.parametrize(("moves", "unverified", "expected"), [
    ([], 0, "generating"),
    ([(Stage.TRAIN, StageState.RUNNING)], 0, "training"),
    ([(Stage.TRAIN, StageState.RUNNING), (Stage.TRAIN, StageState.DONE)], 0, "evaluating"),
    ([(Stage.TRAIN, StageState.DONE), (Stage.EVALUATE, StageState.RUNNING)], 0, "evaluating"),
    ([(Stage.TRAIN, StageState.DONE), (Stage.EVALUATE, StageState.DONE)], 0, "complete"),
    ([(Stage.TRAIN, StageState.DONE), (Stage.EVALUATE, StageState.DONE)], 2, "complete_with_failures"),
    ([(Stage.TRAIN, StageState.DONE), (Stage.EVALUATE, StageState.RUNNING), (Stage.EVALUATE, StageState.SKIPPED)], 0,
     "complete"),
    ([(Stage.TRAIN, StageState.FAILED)], 0, "failed"),
    ([(Stage.TRAIN, StageState.DONE), (Stage.EVALUATE, StageState.FAILED)], 0, "failed"),
])
def test_the_status_reads_the_phase_each_stage_move_stored(data_dir, redis_conn, moves, unverified, expected):
    state = RunState(redis_conn, data_dir, "moved")
    RunSpec(name="moved", dataset="d", model="m", rows=4, train_ids=4).save(data_dir)
    state.register(4, state="generating")
    for sample_id in range(unverified):
        state.mark_failed(Failure(run="moved", stage=Stage.EXTRACT, sample_id=sample_id, error_class="E", message="m"))
    state.set_phase(RunPhase.EXTRACTING)
    if moves:
        state.set_phase(RunPhase.TRAINING)
    else:
        state.set_phase(RunPhase.GENERATING)  # a retry sent it back: the stored phase, nothing derived
    for stage, new in moves:
        state.set_stage(stage, new)
    assert run_status(data_dir, redis_conn, "moved")["state"] == expected == state.phase()


def test_operator_text_names_progress_errors_rate_eta_and_disk(data_dir, redis_conn, state):
    text = format_status(run_status(data_dir, redis_conn, RUN))
    assert text.startswith(f"run {RUN}: generating (10 samples expected)")
    assert re.search(r"generate +7 / 10 +100\.0% +failed 2 +dropped 1 +unknown samples/s +ETA 0s", text)
    assert re.search(r"extract +3 / 7 +57\.1% +failed 1 +dropped 0 +unknown samples/s +ETA unknown", text)
    assert re.search(r"\n  ETA +unknown\n", text)
    assert "3 total, 3 since resume, 1 dropped" in text
    assert "samples/s" in text and "ETA" in text and "free of" in text
    assert "sample 2 " in text and "InvalidJson" in text and "HiddenStateFileError" in text


def test_unknown_run_is_not_found_and_list_covers_every_run(data_dir, redis_conn, state):
    with pytest.raises(RunNotFound):
        run_status(data_dir, redis_conn, "nope")
    assert [s["run"] for s in list_status(data_dir, redis_conn)] == [RUN]


@pytest.fixture()
def bursty(data_dir, redis_conn, tmp_path) -> RunState:
    """1000 samples to generate (one more row held out), none settled yet."""
    dataset = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"q{i}"} for i in range(1001)])
    submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name="bursty", model="m",
                                             evaluate=EvalConfig(holdout=1)))
    return RunState(redis_conn, data_dir, "bursty")


def land(state: RunState, burst: int, at: float) -> None:
    for j in range(BURST):
        state.mark_done("generate", burst * BURST + j, now=at)


def test_a_burst_at_the_start_is_an_unknown_rate_and_eta_not_an_eta_of_0(data_dir, redis_conn, bursty):
    land(bursty, 0, T0)
    status = run_status(data_dir, redis_conn, "bursty", now=T0 + 0.01)
    gen = status["stages"]["generate"]
    assert (gen["done"], gen["remaining"]) == (50, 950)
    assert (gen["samples_per_second"], gen["eta_seconds"], status["eta_seconds"]) == (None, None, None)
    text = format_status(status)
    assert re.search(r"generate +50 / 1,000 .* unknown samples/s +ETA unknown", text)
    assert re.search(r"extract +0 / 1,000 .* 0\.00 samples/s +ETA unknown", text)  # nothing extracted yet


def test_rate_and_eta_stay_within_a_burst_over_the_window_of_the_truth(data_dir, redis_conn, bursty):
    """13 bursts in 120 s, read at 125 s: |rate - 5| <= 50 / 125, so the ETA of the 350 left is 65-76 s."""
    for burst in range(13):
        land(bursty, burst, T0 + burst * EVERY)
    status = run_status(data_dir, redis_conn, "bursty", now=T0 + 125)
    gen = status["stages"]["generate"]
    assert (gen["remaining"], gen["rate_window_seconds"]) == (350, 125.0)
    bound = BURST / gen["rate_window_seconds"]
    assert abs(gen["samples_per_second"] - BURST / EVERY) <= bound
    assert 350 / (BURST / EVERY + bound) <= gen["eta_seconds"] <= 350 / (BURST / EVERY - bound)
    assert gen["eta_seconds"] == round(350 / gen["samples_per_second"])
    text = format_status(status)
    assert re.search(rf"generate .* {gen['samples_per_second']:.2f} samples/s over 2m05s +ETA 1m0\ds", text)
    # Extraction has not started, so the run's ETA is unknown rather than generation's alone.
    assert status["stages"]["extract"]["eta_seconds"] is None and status["eta_seconds"] is None
    for burst in range(13, 20):
        land(bursty, burst, T0 + burst * EVERY)
    done = run_status(data_dir, redis_conn, "bursty", now=T0 + 200)["stages"]["generate"]
    assert (done["remaining"], done["eta_seconds"]) == (0, 0)


def test_generation_reports_its_requests_per_settled_sample(data_dir, redis_conn, state):
    """Ten samples settled (seven done, the malformed row and one more failed, one dropped); a conversation
    of several turns costs a request a turn, counted by the generate job."""
    assert run_status(data_dir, redis_conn, RUN)["stages"]["generate"]["requests"] == 0
    state.incr_many({"generate_requests": 21})
    generate = run_status(data_dir, redis_conn, RUN)["stages"]["generate"]
    assert (generate["requests"], generate["requests_per_sample"]) == (21, 2.1)
    assert "2.10 requests/sample" in format_status(run_status(data_dir, redis_conn, RUN)).splitlines()[1]
    # Rebuilt from the volume after replies were made (reconcile sets the mark): the count began again there, so
    # neither figure is the run's; unknown, not a mean over requests the count never saw.
    state.set_meta(generate_requests_uncounted=1)
    status = run_status(data_dir, redis_conn, RUN)
    assert (status["stages"]["generate"]["requests"], status["stages"]["generate"]["requests_per_sample"]) == \
        (None, None)
    assert "requests/sample unknown (state read back from the volume)" in format_status(status).splitlines()[1]


def test_a_pause_for_disk_space_names_the_stages_it_holds_and_their_eta_reads_paused(data_dir, redis_conn, state):
    for sample_id in (0, 1):  # generation has samples left
        state.clear_done("generate", sample_id)
    set_paused(redis_conn, RUN, "1.0 MiB still needed for 3 samples; 0 B free on /data")
    status = run_status(data_dir, redis_conn, RUN)
    gen, ext = status["stages"]["generate"], status["stages"]["extract"]
    assert status["disk"]["holds"] == ["generate", "extract"] and status["paused"] is True
    assert gen["paused"] and ext["paused"] and gen["eta_seconds"] is None and ext["eta_seconds"] is None
    assert status["eta_seconds"] is None
    text = format_status(status)
    assert "ETA paused" in text.splitlines()[1] and "ETA paused" in text.splitlines()[2]
    assert "  ETA       paused (waiting for disk space)" in text
    assert ("  PAUSED    new prompts held back and extraction waits for disk space: 1.0 MiB still needed for 3 "
            "samples; 0 B free on /data") in text
    # A stage with nothing left is not held by the pause: its ETA stays 0.
    for sample_id in (0, 1):
        state.mark_done("generate", sample_id)
    status = run_status(data_dir, redis_conn, RUN)
    assert not status["stages"]["generate"]["paused"] and status["stages"]["extract"]["paused"]
    clear_paused(redis_conn, RUN)
    status = run_status(data_dir, redis_conn, RUN)
    assert not status["paused"] and not status["stages"]["extract"]["paused"] and "PAUSED" not in format_status(status)


def test_a_writer_waiting_for_disk_space_holds_its_stage_by_name(data_dir, redis_conn, state):
    hold = StageHold(redis_conn, RUN, Stage.TRAIN)
    hold.hold("writing checkpoint step 50 found /data full (0 B free: No space left on device)")
    status = run_status(data_dir, redis_conn, RUN)
    assert status["disk"]["holds"] == ["train"] and status["stages"]["train"]["paused"] and status["paused"]
    assert not status["stages"]["extract"]["paused"] and not status["stages"]["evaluate"]["paused"]
    text = format_status(status)
    assert "  PAUSED    train waits for disk space: writing checkpoint step 50 found /data full" in text
    assert "(paused: waiting for disk space)" in next(line for line in text.splitlines() if line.startswith("  train"))
    hold.release()
    assert run_status(data_dir, redis_conn, RUN)["disk"]["holds"] == []
    hold.hold("again")
    release_stages(redis_conn, RUN)  # a train or evaluate job starting again forgets a killed writer's hold
    assert run_status(data_dir, redis_conn, RUN)["disk"]["held"] == {}
    # A hold its writer stopped renewing (killed while it waited) is not shown.
    stale = {"reason": "writing the reply of sample 3 found /data full", "at": time.time() - HOLD_STALE_S - 1}
    redis_conn.hset(RunKeys(RUN).meta, held_field(Stage.GENERATE), json.dumps(stale))
    assert run_status(data_dir, redis_conn, RUN)["disk"]["held"] == {}
    redis_conn.hset(RunKeys(RUN).meta, held_field(Stage.GENERATE), json.dumps({**stale, "at": time.time()}))
    assert run_status(data_dir, redis_conn, RUN)["stages"]["generate"]["paused"] is False  # nothing left to generate
    assert run_status(data_dir, redis_conn, RUN)["disk"]["held"] == {"generate": stale["reason"]}
