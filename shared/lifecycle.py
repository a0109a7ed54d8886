"""A run's lifecycle: its phases, the states of its whole-run stages, and the transitions between them.

The run's phase is the ``state`` field of its Redis meta; the train and evaluate stages keep theirs in
``train_state`` and ``evaluate_state``. The values are the strings stored today, so meta already in
Redis and ``state.json`` records already on the volume read back as members. Every write of these
fields goes through ``advance``, which refuses a transition the tables below do not list;
``runtime.runstate.RunState.set_phase`` and ``set_stage`` are the writers. The one write outside them is
a submission's ``register``, which creates the run as ``RunPhase.GENERATING`` (queued -> generating).
"""

from __future__ import annotations

from enum import StrEnum

from shared.errors import DraftlineError


class IllegalTransition(DraftlineError):
    """A writer asked for a phase or stage state that the current one cannot move to."""

    def __init__(self, current: StrEnum, new: StrEnum) -> None:
        super().__init__(current, new)  # both as args, so the exception pickles (RQ, worker processes)
        self.current, self.new = current, new

    def __str__(self) -> str:
        return f"illegal transition {self.current.value!r} -> {self.new.value!r}"


class RunPhase(StrEnum):
    """Where a run stands (the ``state`` meta field, and ``state`` of ``runs/<run>/state.json``)."""

    QUEUED = "queued"  # never written: the phase of a run whose meta has no ``state`` yet
    GENERATING = "generating"
    EXTRACTING = "extracting"
    TRAINING = "training"
    EVALUATING = "evaluating"
    COMPLETE = "complete"
    COMPLETE_WITH_FAILURES = "complete_with_failures"
    FAILED = "failed"

    @classmethod
    def of(cls, stored: str | None) -> RunPhase:
        """The phase a stored value names; an absent or empty one is QUEUED."""
        return cls(stored) if stored else cls.QUEUED

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_PHASES


class StageState(StrEnum):
    """State of a whole-run stage (the ``train_state`` and ``evaluate_state`` meta fields)."""

    PENDING = "pending"  # never written: the state of a stage whose field is absent
    RUNNING = "running"
    DONE = "done"
    SKIPPED = "skipped"  # evaluation without held-out rows: nothing to measure, and nothing left to do
    FAILED = "failed"

    @classmethod
    def of(cls, stored: str | None) -> StageState:
        """The state a stored value names; an absent or empty one is PENDING."""
        return cls(stored) if stored else cls.PENDING

    @classmethod
    def _missing_(cls, value: object) -> StageState | None:
        # status.py once lowered the value before reading it; a differently cased one still reads.
        if isinstance(value, str) and value != value.lower():
            return cls(value.lower())
        return None

    @property
    def finished(self) -> bool:
        return self in (StageState.DONE, StageState.SKIPPED)


SAMPLE_PHASES = (RunPhase.QUEUED, RunPhase.GENERATING, RunPhase.EXTRACTING)  # the supervisor feeds these
TERMINAL_PHASES = (RunPhase.COMPLETE, RunPhase.COMPLETE_WITH_FAILURES, RunPhase.FAILED)

# Rewriting the current value is always accepted (see ``advance``), so the tables list moves only.
PHASE_TRANSITIONS: dict[RunPhase, frozenset[RunPhase]] = {
    # A run without a phase is being submitted, or rebuilt from the volume, which may hold any phase.
    RunPhase.QUEUED: frozenset(RunPhase) - {RunPhase.QUEUED},
    # Samples settle (extracting, training), or none makes it through extraction (failed).
    RunPhase.GENERATING: frozenset({RunPhase.EXTRACTING, RunPhase.TRAINING, RunPhase.FAILED}),
    # A retry or a resume sends the feeder back over the prompts (generating).
    RunPhase.EXTRACTING: frozenset({RunPhase.GENERATING, RunPhase.TRAINING, RunPhase.FAILED}),
    # A resume that finds an evaluation report moves a training run on (evaluating).
    RunPhase.TRAINING: frozenset({RunPhase.EVALUATING, *TERMINAL_PHASES}),
    RunPhase.EVALUATING: frozenset(TERMINAL_PHASES),
    # A retry reopens a finished run, and a resume reopens one whose finished record is gone.
    RunPhase.COMPLETE: frozenset({RunPhase.GENERATING}),
    RunPhase.COMPLETE_WITH_FAILURES: frozenset({RunPhase.GENERATING}),
    RunPhase.FAILED: frozenset({RunPhase.GENERATING}),
}

# A job may (re)start or fail from any state: a requeued job starts over, and a job can fail before it
# reports running. It finishes (done, skipped) only from running, but for one writer: a resume restores a
# lost run's stages as done from the evaluation report on the volume (pending -> done).
STAGE_TRANSITIONS: dict[StageState, frozenset[StageState]] = {
    StageState.PENDING: frozenset({StageState.RUNNING, StageState.FAILED, StageState.DONE}),
    StageState.RUNNING: frozenset({StageState.DONE, StageState.SKIPPED, StageState.FAILED}),
    StageState.DONE: frozenset({StageState.RUNNING, StageState.FAILED}),
    StageState.SKIPPED: frozenset({StageState.RUNNING, StageState.FAILED}),
    StageState.FAILED: frozenset({StageState.RUNNING}),
}


def advance(current: RunPhase | StageState, new: RunPhase | StageState) -> RunPhase | StageState:
    """``new`` when the tables allow ``current -> new`` or ``new`` is ``current``; else IllegalTransition.

    Rewriting the current value is accepted: a writer that crashed after its write and runs again
    (a requeued job, the supervisor's next pass) writes the same value twice."""
    table = PHASE_TRANSITIONS if isinstance(current, RunPhase) else STAGE_TRANSITIONS
    if type(new) is not type(current):
        raise TypeError(f"cannot move a {type(current).__name__} to a {type(new).__name__}")
    if new != current and new not in table[current]:
        raise IllegalTransition(current, new)
    return new
