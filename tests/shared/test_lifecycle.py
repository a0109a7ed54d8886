from __future__ import annotations

import json
import pickle

import pytest

from shared.lifecycle import (
    PHASE_TRANSITIONS,
    STAGE_TRANSITIONS,
    IllegalTransition,
    RunPhase,
    StageState,
    advance,
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
