from __future__ import annotations

import json
import pickle

import pytest

from shared.lifecycle import (
    PHASE_TRANSITIONS,
    STAGE_TRANSITIONS,
    Failure,
    FailureKind,
    IllegalTransition,
    KeyType,
    Outcome,
    RunKeys,
    RunPhase,
    SampleResult,
    Stage,
    StageState,
    advance,
    phase_for_stage,
    phase_of_stages,
    sample_stage,
)
from runtime.runstate import RunState

# The strings written to Redis meta and to runs/<run>/state.json before the enums existed.
STORED_PHASES = ["queued", "generating", "extracting", "training", "evaluating", "complete",
                 "complete_with_failures", "failed"]
STORED_STAGE_STATES = ["running", "done", "skipped", "failed"]

PHASE_MOVES = [(a, b) for a, targets in PHASE_TRANSITIONS.items() for b in sorted(targets)]
STAGE_MOVES = [(a, b) for a, targets in STAGE_TRANSITIONS.items() for b in sorted(targets)]


@pytest.mark.parametrize(("current", "new"), PHASE_MOVES + STAGE_MOVES)
def test_every_legal_transition_is_accepted(current, new):
    assert advance(current, new) is new


@pytest.mark.parametrize("value", [*RunPhase, *StageState])
def test_rewriting_the_current_value_is_accepted(value):
    assert advance(value, value) is value


@pytest.mark.parametrize(("current", "new"), [
    (RunPhase.COMPLETE, RunPhase.TRAINING),
    (RunPhase.EVALUATING, RunPhase.GENERATING),
    (RunPhase.FAILED, RunPhase.COMPLETE),
    (StageState.PENDING, StageState.SKIPPED),
    (StageState.FAILED, StageState.DONE),
    (StageState.DONE, StageState.SKIPPED),
])
def test_an_illegal_transition_is_refused_naming_both_states(current, new):
    with pytest.raises(IllegalTransition, match=f"'{current.value}' -> '{new.value}'") as raised:
        advance(current, new)
    assert (raised.value.current, raised.value.new) == (current, new)


def test_a_phase_and_a_stage_state_do_not_mix():
    with pytest.raises(TypeError):
        advance(RunPhase.TRAINING, StageState.DONE)


def test_every_member_has_its_row_in_the_table():
    assert set(PHASE_TRANSITIONS) == set(RunPhase) and set(STAGE_TRANSITIONS) == set(StageState)


@pytest.mark.parametrize("stored", STORED_PHASES)
def test_a_stored_phase_round_trips(stored):
    phase = RunPhase.of(stored)
    assert phase.value == stored and str(phase) == stored and f"{phase}" == stored
    assert json.loads(json.dumps({"state": phase})) == {"state": stored}


@pytest.mark.parametrize("stored", STORED_STAGE_STATES)
def test_a_stored_stage_state_round_trips(stored):
    state = StageState.of(stored)
    assert state.value == stored and str(state) == stored and StageState.of(stored.upper()) is state


def test_an_absent_value_reads_as_the_start():
    assert RunPhase.of(None) is RunPhase.of("") is RunPhase.QUEUED
    assert StageState.of(None) is StageState.of("") is StageState.PENDING


def test_an_unknown_value_is_refused():
    with pytest.raises(ValueError):
        StageState.of("completed")
    with pytest.raises(ValueError):
        RunPhase.of("done")


def test_run_state_writes_only_legal_transitions(redis_conn, tmp_path):
    state = RunState(redis_conn, tmp_path, "r")
    state.register(3, state="generating")
    state.set_phase(RunPhase.EXTRACTING, feed_offset=7)
    assert state.meta()["state"] == "extracting" and state.meta()["feed_offset"] == "7"
    with pytest.raises(IllegalTransition):
        state.set_phase(RunPhase.COMPLETE, finished_at=1.0)
    assert state.phase() is RunPhase.EXTRACTING and "finished_at" not in state.meta()  # nothing written

    state.set_stage("train", StageState.RUNNING, train_started_at=2.0)
    state.set_stage("train", StageState.DONE)
    with pytest.raises(IllegalTransition, match="'done' -> 'skipped'"):
        state.set_stage("train", StageState.SKIPPED)
    assert state.meta()["train_state"] == "done"


def test_an_illegal_transition_survives_pickling():
    again = pickle.loads(pickle.dumps(IllegalTransition(RunPhase.FAILED, RunPhase.COMPLETE)))
    assert str(again) == "illegal transition 'failed' -> 'complete'"


# ---- stages, outcomes and the failure record -------------------------------------------------------------


def test_the_stages_are_in_order_and_the_first_two_work_per_sample():
    assert list(Stage) == ["generate", "extract", "train", "evaluate"]
    assert [s.per_sample for s in Stage] == [True, True, False, False]
    assert sample_stage("extract") is Stage.EXTRACT
    with pytest.raises(ValueError, match="per-sample stage"):
        sample_stage("train")


def test_a_failure_kind_settles_as_its_outcome_and_result():
    assert FailureKind.ERROR.outcome is Outcome.FAILED and FailureKind.DROPPED.outcome is Outcome.DROPPED
    assert FailureKind.ERROR.result is SampleResult.FAILED and FailureKind.DROPPED.result is SampleResult.DROPPED


def test_a_failure_record_round_trips_as_the_json_stored_before_the_enums():
    # What runtime.runstate wrote before the record moved here: plain strings for stage and kind.
    stored = ('{"at": 5.0, "error_class": "ReplyTooShort", "kind": "dropped", "message": "m", "run": "r", '
              '"sample_id": 7, "stage": "generate"}')
    failure = Failure.from_json(stored)
    assert failure == Failure(run="r", stage=Stage.GENERATE, sample_id=7, error_class="ReplyTooShort", message="m",
                              kind=FailureKind.DROPPED, at=5.0)
    assert failure.to_json() == stored and failure.field == "generate:7"


# ---- the phase whole-run stages give ------------------------------------------------------------------------


@pytest.mark.parametrize(("stage", "state", "unverified", "phase"), [
    (Stage.TRAIN, StageState.PENDING, 0, None),
    (Stage.TRAIN, StageState.RUNNING, 0, RunPhase.TRAINING),
    (Stage.TRAIN, StageState.DONE, 3, RunPhase.EVALUATING),
    (Stage.TRAIN, StageState.FAILED, 0, RunPhase.FAILED),
    (Stage.EVALUATE, StageState.RUNNING, 0, RunPhase.EVALUATING),
    (Stage.EVALUATE, StageState.DONE, 0, RunPhase.COMPLETE),
    (Stage.EVALUATE, StageState.DONE, 1, RunPhase.COMPLETE_WITH_FAILURES),
    (Stage.EVALUATE, StageState.SKIPPED, 0, RunPhase.COMPLETE),
    (Stage.EVALUATE, StageState.SKIPPED, 2, RunPhase.COMPLETE_WITH_FAILURES),
    (Stage.EVALUATE, StageState.FAILED, 0, RunPhase.FAILED),
])
def test_a_whole_run_stage_state_gives_one_phase(stage, state, unverified, phase):
    assert phase_for_stage(stage, state, unverified=unverified) is phase


def test_every_phase_a_stage_gives_is_reachable_from_the_one_before_it():
    # The trainer's moves in order, and a requeued or retried job starting again, pass the transition table.
    order = [(Stage.TRAIN, StageState.RUNNING), (Stage.TRAIN, StageState.DONE), (Stage.EVALUATE, StageState.RUNNING),
             (Stage.EVALUATE, StageState.DONE)]
    phase = RunPhase.TRAINING
    for stage, state in order:
        phase = advance(phase, phase_for_stage(stage, state, unverified=0))
    assert phase is RunPhase.COMPLETE
    assert advance(RunPhase.EVALUATING, RunPhase.TRAINING) is RunPhase.TRAINING  # a requeued train job
    assert advance(RunPhase.FAILED, RunPhase.TRAINING) is RunPhase.TRAINING  # a failed training run again


def test_a_run_read_back_takes_its_phase_from_the_last_stage_that_began():
    assert phase_of_stages({}, unverified=0) is None
    assert phase_of_stages({Stage.TRAIN: StageState.RUNNING}, unverified=0) is RunPhase.TRAINING
    both = {Stage.TRAIN: StageState.DONE, Stage.EVALUATE: StageState.DONE}
    assert phase_of_stages(both, unverified=4) is RunPhase.COMPLETE_WITH_FAILURES


# ---- the keys a run owns ---------------------------------------------------------------------------------------


def test_a_runs_keys_keep_the_names_stored_before_the_layout_was_written_down():
    keys = RunKeys("r")
    assert keys.meta == "draftline:run:r:meta" and keys.failures == "draftline:run:r:failures"
    assert keys.outcome(Stage.EXTRACT, Outcome.DONE) == "draftline:run:r:done:extract"
    assert keys.settled(Stage.GENERATE) == "draftline:run:r:settled:generate"
    assert keys.reconcile_lock == "draftline:reconcile-lock:r"
    with pytest.raises(ValueError, match="per-sample stage"):
        keys.outcome(Stage.TRAIN, Outcome.DONE)
    types = keys.types()
    assert types[keys.meta] is KeyType.HASH and types[keys.outcome(Stage.GENERATE, Outcome.DROPPED)] is KeyType.STRING
    assert keys.disk_claims == "draftline:run:r:disk-claims" and types[keys.disk_claims] is KeyType.HASH
    assert len(types) == 7 + 2 * (1 + 2 * len(Outcome))
