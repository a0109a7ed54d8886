"""A run's lifecycle, in one place: its stages, what becomes of each sample, the run's phases and its
whole-run stages' states with the transitions between them, and the Redis keys a run owns.

A run goes through four stages (``Stage``). The first two work sample by sample: each sample of a per-sample
stage settles as one ``Outcome`` (done: a verified file; failed or dropped: a named ``Failure`` on the volume
and in Redis). The last two work on the whole run, and keep one ``StageState`` each. The run's phase
(``RunPhase``) is the ``state`` field of its Redis meta and of ``runs/<run>/state.json``; every write of a
phase or a stage state goes through ``advance``, which refuses a transition the tables below do not list
(``runtime.runstate.RunState.set_phase`` and ``set_stage`` are the writers; a submission's ``register``
creates the run as ``RunPhase.GENERATING``). A whole-run stage's state decides the run's phase by one rule,
``phase_for_stage``, used both when a stage moves and when a run is read back from the volume.

The values are the strings stored today, so meta already in Redis and records already on the volume read back
as members; ``RunKeys`` names every Redis key a run owns, with its type.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import StrEnum

from shared.errors import DraftlineError


# ---- stages and a sample's outcomes -------------------------------------------------------------------


class Stage(StrEnum):
    """The stages a run goes through, in order."""

    GENERATE = "generate"  # per sample: the target's reply to each prompt
    EXTRACT = "extract"  # per sample: the hidden states of prompt and reply, one verified file
    TRAIN = "train"  # whole run: the drafter trained on the files, and exported
    EVALUATE = "evaluate"  # whole run: the export's acceptance against the target

    @property
    def per_sample(self) -> bool:
        return self in SAMPLE_STAGES


SAMPLE_STAGES = (Stage.GENERATE, Stage.EXTRACT)  # settle sample by sample (Redis bitmaps, failure records)
WHOLE_RUN_STAGES = (Stage.TRAIN, Stage.EVALUATE)  # one state each (``<stage>_state`` meta fields)


def sample_stage(value: str) -> Stage:
    """The per-sample stage ``value`` names; ValueError for a whole-run stage or any other word."""
    stage = Stage(value)
    if not stage.per_sample:
        raise ValueError(f"per-sample stage must be one of {[s.value for s in SAMPLE_STAGES]}, got {value!r}")
    return stage


class Outcome(StrEnum):
    """How a sample settled in a per-sample stage: one Redis bitmap per outcome and stage."""

    DONE = "done"  # its output is on the volume, verified
    FAILED = "failed"  # an error stopped it; named in a Failure record
    DROPPED = "dropped"  # filtered on purpose (a reply too short, say); named in a Failure record


OUTCOMES = tuple(Outcome)


class SampleResult(StrEnum):
    """What one job's attempt at a sample came to; a generate or extract job returns their counts by name."""

    DONE = "done"  # settled as Outcome.DONE by this attempt
    FAILED = "failed"  # settled as Outcome.FAILED
    DROPPED = "dropped"  # settled as Outcome.DROPPED
    SKIPPED = "skipped"  # its output was on the volume already (an earlier, killed attempt): nothing to do again
    DEFERRED = "deferred"  # an online run's budget is full: left unsettled, for its trainer to ask for again


class FailureKind(StrEnum):
    """Why a sample did not make it through a stage: an error, or a drop on purpose."""

    ERROR = "error"
    DROPPED = "dropped"

    @property
    def outcome(self) -> Outcome:
        return Outcome.DROPPED if self is FailureKind.DROPPED else Outcome.FAILED

    @property
    def result(self) -> SampleResult:
        return SampleResult.DROPPED if self is FailureKind.DROPPED else SampleResult.FAILED


@dataclass(frozen=True)
class Failure:
    """One sample that did not make it through a stage, and why: written to the volume
    (``runs/<run>/failures/<stage>/<id>.json``) first, then to the run's failures hash in Redis."""

    run: str
    stage: str  # a per-sample Stage
    sample_id: int
    error_class: str
    message: str
    kind: str = FailureKind.ERROR
    at: float = 0.0  # when it was recorded (Unix seconds); 0 until recorded

    @property
    def field(self) -> str:
        """Its field in the run's failures hash."""
        return failure_field(self.stage, self.sample_id)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Failure:
        return cls(**json.loads(raw))


def failure_field(stage: str, sample_id: int) -> str:
    """``<stage>:<sample id>``: a failure's field in the run's failures hash."""
    return f"{stage}:{sample_id}"


# ---- the run's phase and its whole-run stages' states -----------------------------------------------


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
    # Training ends: its evaluation starts (evaluating), or it fails; a resume that finds an evaluation report
    # moves a training run on to the report's end.
    RunPhase.TRAINING: frozenset({RunPhase.EVALUATING, *TERMINAL_PHASES}),
    # A train job that the reaper requeued after it reported done starts over (training).
    RunPhase.EVALUATING: frozenset({RunPhase.TRAINING, *TERMINAL_PHASES}),
    # A retry reopens a finished run, and a resume reopens one whose finished record is gone; an evaluation that
    # wrote its report, then failed its checks while a resume restored the run as complete from that report, fails it.
    RunPhase.COMPLETE: frozenset({RunPhase.GENERATING, RunPhase.FAILED}),
    RunPhase.COMPLETE_WITH_FAILURES: frozenset({RunPhase.GENERATING, RunPhase.FAILED}),
    # A failed run is reopened (generating), or its train or evaluate job runs again (training, evaluating).
    RunPhase.FAILED: frozenset({RunPhase.GENERATING, RunPhase.TRAINING, RunPhase.EVALUATING}),
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


def phase_for_stage(stage: Stage, state: StageState, *, unverified: int) -> RunPhase | None:
    """The run's phase once whole-run ``stage`` is in ``state``; None where it moves no phase (pending).

    A failed stage fails the run. Training runs in ``training`` and, done, hands the run to its evaluation;
    evaluation runs in ``evaluating`` and, done or skipped, completes the run: ``complete`` only when every
    expected sample made it through (``unverified``: the samples that settled failed or dropped)."""
    if state is StageState.FAILED:
        return RunPhase.FAILED
    if state is StageState.RUNNING:
        return RunPhase.TRAINING if stage is Stage.TRAIN else RunPhase.EVALUATING
    if state.finished:
        if stage is Stage.TRAIN:
            return RunPhase.EVALUATING
        return RunPhase.COMPLETE_WITH_FAILURES if unverified else RunPhase.COMPLETE
    return None


def phase_of_stages(states: dict[Stage, StageState], *, unverified: int) -> RunPhase | None:
    """The phase whole-run stages in ``states`` give a run read back (``phase_for_stage`` of the last stage
    that began); None where none began."""
    for stage in reversed(WHOLE_RUN_STAGES):
        state = states.get(stage, StageState.PENDING)
        if state is not StageState.PENDING:
            return phase_for_stage(stage, state, unverified=unverified)
    return None


# ---- the Redis keys a run owns -----------------------------------------------------------------------

KEY_PREFIX = "draftline"
RUNS_KEY = f"{KEY_PREFIX}:runs"  # set: the name of every run Redis knows


class KeyType(StrEnum):
    """A key's type as Redis' TYPE names it (a bitmap is a string)."""

    STRING = "string"
    HASH = "hash"
    SET = "set"


@dataclass(frozen=True)
class RunKeys:
    """Every Redis key one run owns, each with its type (``types``). The volume stays the truth: each of these
    can be rebuilt from it (``services.controller.loop.reconcile``), but for the short-lived locks."""

    run: str

    def _key(self, suffix: str) -> str:
        return f"{KEY_PREFIX}:run:{self.run}:{suffix}"

    @property
    def meta(self) -> str:
        """hash: the run's fields (``expected``, ``state``, ``<stage>_state``, counters, progress)."""
        return self._key("meta")

    @property
    def failures(self) -> str:
        """hash: ``failure_field(stage, sample id)`` -> the Failure's JSON, for every failed or dropped sample."""
        return self._key("failures")

    def outcome(self, stage: Stage, outcome: Outcome) -> str:
        """string (a bitmap): bit ``sample id`` set for each sample of per-sample ``stage`` that settled so."""
        return self._key(f"{Outcome(outcome)}:{sample_stage(stage)}")

    def settled(self, stage: Stage) -> str:
        """hash: per-sample ``stage``'s throughput: samples settled per time bucket, and when it began
        (``runtime.runstate.Throughput``)."""
        return self._key(f"settled:{sample_stage(stage)}")

    def merge_scratch(self, stage: Stage, outcome: Outcome) -> str:
        """string (a bitmap): the samples a rebuild found for ``outcome(stage, outcome)``, OR-ed into it and
        deleted in one transaction."""
        return f"{self.outcome(stage, outcome)}:reconcile"

    @property
    def settled_scratch(self) -> str:
        """string (a bitmap): the supervisor's union of settled samples, made and deleted in one transaction."""
        return self._key("settled")

    @property
    def disk_claims(self) -> str:
        """hash: sample id -> the bytes its hidden-state file is being written with now (``runtime.disk_claims``);
        the volume's free space less these is what another extraction may still write."""
        return self._key("disk-claims")

    @property
    def pattern(self) -> str:
        """Matches every key above (the locks below live apart: they outlast a deleted run's keys)."""
        return self._key("*")

    @property
    def reconcile_lock(self) -> str:
        """string: held while the controller rebuilds the run from the volume (feeding waits)."""
        return f"{KEY_PREFIX}:reconcile-lock:{self.run}"

    @property
    def rebuild_backoff(self) -> str:
        """string: set, with a time to live, after a rebuild failed: the next try waits for it to expire."""
        return f"{KEY_PREFIX}:rebuild-backoff:{self.run}"

    @property
    def submit_lock(self) -> str:
        """string: held while a submission writes the run (a second submission of the name waits)."""
        return f"{KEY_PREFIX}:submit-lock:{self.run}"

    def types(self) -> dict[str, KeyType]:
        """Every key this run can own, with its type."""
        owned = {self.meta: KeyType.HASH, self.failures: KeyType.HASH, self.settled_scratch: KeyType.STRING,
                 self.disk_claims: KeyType.HASH,
                 self.reconcile_lock: KeyType.STRING, self.rebuild_backoff: KeyType.STRING,
                 self.submit_lock: KeyType.STRING}
        for stage in SAMPLE_STAGES:
            owned[self.settled(stage)] = KeyType.HASH
            owned.update({self.outcome(stage, outcome): KeyType.STRING for outcome in OUTCOMES})
            owned.update({self.merge_scratch(stage, outcome): KeyType.STRING for outcome in OUTCOMES})
        return owned
