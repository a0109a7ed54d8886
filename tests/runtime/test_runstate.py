import pytest

from runtime.runstate import (
    RATE_BUCKET_SECONDS,
    RATE_BUCKETS,
    RATE_MIN_SPAN_SECONDS,
    RATE_WINDOW_SECONDS,
    RunState,
    StageCounts,
    known_runs,
    FIELDS,
    read_finished,
    write_finished,
)
from shared.lifecycle import Failure, FailureKind, IllegalTransition, RunKeys, RunPhase, Stage, StageState


@pytest.fixture()
def state(redis_conn, data_dir):
    s = RunState(redis_conn, data_dir, "r")
    s.register(expected=10)
    return s


def test_marking_a_sample_twice_counts_it_once(state):
    assert state.mark_done("generate", 3) is True
    assert state.mark_done("generate", 3) is False
    assert state.counts("generate").done == 1
    assert known_runs(state.conn) == ["r"]


def test_failures_are_named_on_the_volume_and_in_redis(state):
    state.mark_failed(Failure("r", "generate", 4, "RowError", "row 4: no user turn"))
    state.mark_failed(Failure("r", "generate", 6, "ReplyTooShort", "2 < 8 tokens", kind=FailureKind.DROPPED))
    counts = state.counts("generate")
    assert (counts.failed, counts.dropped) == (1, 1)
    assert state.paths.failure("generate", 4).is_file()
    assert [(f.sample_id, f.error_class) for f in state.failures()] == [(4, "RowError"), (6, "ReplyTooShort")]


def test_a_retried_sample_that_succeeds_clears_its_failure(state):
    state.mark_failed(Failure("r", "extract", 2, "InferenceUnavailable", "connection refused"))
    state.mark_done("extract", 2)
    assert state.counts("extract").failed == 0
    assert state.failures() == []
    assert not state.paths.failure("extract", 2).exists()


T0 = 1_700_000_002.5  # not on a bucket edge, so the bounds below hold for any alignment
BURST, EVERY = 50, 10.0  # bursts of 50 every 10 s: a true rate of 5 samples/s
TRUE_RATE = BURST / EVERY


def land_bursts(state: RunState, bursts: int, *, first: float = T0, stage: str = "generate"):
    """Settle ``bursts`` bursts of BURST samples EVERY seconds apart; yields each burst's time once it landed."""
    for i in range(bursts):
        at = first + i * EVERY
        for j in range(BURST):
            state.mark_done(stage, i * BURST + j, now=at)
        yield at


def test_no_samples_is_a_rate_of_zero_and_an_unknown_eta(state):
    throughput = state.throughput("generate", now=T0)
    assert (throughput.settled, throughput.per_second, throughput.eta_seconds(10)) == (0, 0.0, None)


def test_a_finished_stage_has_an_eta_of_zero(state):
    assert state.throughput("generate", now=T0).eta_seconds(0) == 0
    list(land_bursts(state, 1))
    assert state.throughput("generate", now=T0).eta_seconds(0) == 0


def test_a_finished_stage_keeps_the_rate_it_worked_at(state):
    """Ten bursts over 90 s, then idle: read as finished, the window ends at the last burst whenever it is
    read; read as unfinished, the idle time dilutes the rate (and after a whole window it is 0)."""
    last = list(land_bursts(state, 10))[-1]
    worked = state.throughput("generate", now=last, finished=True)
    assert worked.span_s == pytest.approx(last - T0) and worked.per_second == pytest.approx(10 * BURST / (last - T0))
    for idle in (1.0, 60.0, 2 * RATE_WINDOW_SECONDS):
        assert state.throughput("generate", now=last + idle, finished=True) == worked
    assert state.throughput("generate", now=last + 60.0).per_second < worked.per_second
    assert state.throughput("generate", now=last + 2 * RATE_WINDOW_SECONDS).per_second == 0


def test_one_burst_at_the_start_is_no_rate_and_no_eta(state):
    list(land_bursts(state, 1))
    for later in (0.0, 0.001, 1.0, RATE_MIN_SPAN_SECONDS - 0.1):
        throughput = state.throughput("generate", now=T0 + later)
        assert throughput.settled == BURST
        assert throughput.per_second is None and throughput.eta_seconds(51) is None
    # Once observed for the minimum span, 50 samples in 30 s is what the data says.
    throughput = state.throughput("generate", now=T0 + RATE_MIN_SPAN_SECONDS)
    assert throughput.per_second == pytest.approx(BURST / RATE_MIN_SPAN_SECONDS)
    assert throughput.eta_seconds(51) == pytest.approx(51 / (BURST / RATE_MIN_SPAN_SECONDS))


def test_bursts_give_the_true_rate_within_one_burst_over_the_span(state):
    """Bursts of 50 every 10 s for 10 minutes, read every 2.5 s: the rate stays within BURST / span of 5/s,
    which is within BURST / (window - one bucket) once the window is full; the ETA follows."""
    remaining = 1000
    full_window = RATE_WINDOW_SECONDS - RATE_BUCKET_SECONDS
    readings = 0
    for at in land_bursts(state, 60):
        for later in (0.0, 2.5, 5.0, 7.5):
            elapsed = at + later - T0
            throughput = state.throughput("generate", now=T0 + elapsed)
            span = throughput.span_s
            # From the first burst until the window fills, then one window give or take a bucket.
            assert span == pytest.approx(elapsed) if elapsed < full_window else full_window <= span < RATE_WINDOW_SECONDS
            if span < RATE_MIN_SPAN_SECONDS:
                assert throughput.per_second is None and throughput.eta_seconds(remaining) is None
                continue
            bound = BURST / span
            assert abs(throughput.per_second - TRUE_RATE) <= bound + 1e-9
            if elapsed >= full_window:
                assert bound <= BURST / full_window < 0.04 * TRUE_RATE
            eta = throughput.eta_seconds(remaining)
            assert remaining / (TRUE_RATE + bound) - 1e-6 <= eta <= remaining / (TRUE_RATE - bound) + 1e-6
            readings += 1
    assert readings > 200


def test_old_buckets_are_pruned_so_memory_is_bounded(state):
    """A sample every 2 s for four windows: the hash never holds more than a window of buckets."""
    key = RunKeys("r").settled(Stage.EXTRACT)
    for i in range(2 * RATE_WINDOW_SECONDS):
        state.mark_done("extract", i, now=T0 + 2 * i)
        assert state.conn.hlen(key) <= RATE_BUCKETS + len(FIELDS)  # the window's buckets, begun, last, first, total
    assert state.conn.hlen(key) == RATE_BUCKETS + len(FIELDS)
    throughput = state.throughput("extract", now=T0 + 2 * i)
    assert abs(throughput.per_second - 0.5) <= 1.0 / throughput.span_s + 1e-9


def test_a_quiet_window_starts_a_new_observation(state):
    """A stage idle for a whole window (a resume, a retry) measures from its next sample, not over the idle time."""
    list(land_bursts(state, 10))
    restart = T0 + 100 + 2 * RATE_WINDOW_SECONDS
    state.mark_done("generate", 10_000, now=restart)
    for j in range(1, BURST):
        state.mark_done("generate", 10_000 + j, now=restart)
    early = state.throughput("generate", now=restart + 1)
    assert early.settled == BURST and early.span_s == pytest.approx(1.0) and early.per_second is None
    assert state.throughput("generate", now=restart + RATE_MIN_SPAN_SECONDS).per_second == pytest.approx(BURST / 30)


def test_every_outcome_settles_a_sample_once(state):
    """Done, failed and dropped all count, each sample once per time it goes from unsettled to settled,
    as ``remaining`` does."""
    at = T0
    state.mark_done("extract", 1, now=at)
    state.mark_done("extract", 1, now=at)  # done again: nothing new settled
    state.mark_failed(Failure("r", "extract", 2, "InferenceUnavailable", "refused", at=at))
    state.mark_done("extract", 2, now=at)  # a failed sample that succeeds on retry: settled already
    state.mark_failed(Failure("r", "extract", 3, "ReplyTooShort", "2 < 8 tokens", kind=FailureKind.DROPPED, at=at))
    state.mark_failed(Failure("r", "extract", 3, "ReplyTooShort", "2 < 8 tokens", kind=FailureKind.DROPPED, at=at))
    assert state.throughput("extract", now=at).settled == 3
    state.clear_failure("extract", 3)  # back to unsettled: its next outcome settles it again
    state.mark_done("extract", 3, now=at)
    assert state.throughput("extract", now=at).settled == 4


def test_a_row_named_at_submission_does_not_count(state):
    state.mark_failed(Failure("r", "generate", 4, "InvalidJson", "row 4"), count_in_rate=False)
    assert state.throughput("generate").settled == 0 and state.counts("generate").failed == 1


def test_unknown_stage_is_refused(state):
    with pytest.raises(ValueError):
        state.mark_done("train", 1)


def test_marking_many_at_once_returns_the_newly_done_clears_their_failures_and_counts_each_once(state):
    state.mark_done("generate", 1)
    state.mark_failed(Failure("r", "generate", 2, "InferenceUnavailable", "connection refused"))
    assert state.mark_done_many("generate", [1, 2, 3]) == [2, 3]
    assert state.counts("generate") == StageCounts(done=3, failed=0, dropped=0)
    assert not state.paths.failure("generate", 2).exists() and state.failures() == []
    # Settled once each: 1 as done, 2 as failed (its success now settles nothing again), 3 as done now.
    assert state.throughput("generate").settled == 3
    assert state.mark_done_many("generate", []) == []


def test_a_samples_landed_counts_join_its_done_bit_once_however_often_it_is_marked(state):
    """The counts of a sample's file are added with its done bit, so a job run again after a kill (which marks
    the samples it finished once more) counts nothing twice; samples without counts add nothing."""
    assert state.mark_done("extract", 4, landed={"hidden_bytes": 1000, "hidden_tokens": 10}) is True
    assert state.mark_done("extract", 4, landed={"hidden_bytes": 1000, "hidden_tokens": 10}) is False
    sizes = {4: {"hidden_bytes": 1000.0}, 5: {"hidden_bytes": 250.5}, 6: {"hidden_tokens": 3}}
    assert state.mark_done_many("extract", [4, 5, 6, 7], landed=sizes) == [5, 6, 7]
    meta = state.meta()
    assert (float(meta["hidden_bytes"]), float(meta["hidden_tokens"])) == (1250.5, 13.0)
    assert state.counts("extract").done == 4 and state.throughput("extract").settled == 4


def test_a_finished_stage_longer_than_the_window_reads_its_whole_run(state):
    """2,000 samples in the first 200 s, then 200 over 400 s: done, the stage reads every sample over its
    whole 600 s, not its slow last window, and not diluted by idle time after it."""
    times = [T0 + i * 0.1 for i in range(2000)] + [T0 + 200.0 + (i + 1) * 2.0 for i in range(200)]
    for sample_id, at in enumerate(times):
        state.mark_done("generate", sample_id, now=at)
    whole = state.throughput("generate", now=times[-1] + 3600.0, finished=True)
    assert whole.settled == 2200 and whole.span_s == pytest.approx(times[-1] - T0)
    assert whole.per_second == pytest.approx(2200 / (times[-1] - T0))
    last_window = state.throughput("generate", now=times[-1])
    assert last_window.per_second == pytest.approx(0.5, rel=0.05)  # what the stage did lately, while running


# ---- whole-run stages move the run's phase ---------------------------------------------------------------


def _training(state: RunState) -> RunState:
    state.register(4, state="generating")
    state.set_phase(RunPhase.TRAINING, train_enqueued_at=1.0)
    return state


def test_a_stage_move_stores_the_phase_it_gives_in_the_same_write(redis_conn, data_dir):
    state = _training(RunState(redis_conn, data_dir, "moves"))
    assert state.set_stage(Stage.TRAIN, StageState.RUNNING) is RunPhase.TRAINING
    assert state.set_stage(Stage.TRAIN, StageState.DONE, export_path="/x") is RunPhase.EVALUATING
    assert state.meta()["state"] == "evaluating" and state.meta()["export_path"] == "/x"
    state.mark_failed(Failure(run="moves", stage=Stage.GENERATE, sample_id=3, error_class="E", message="m",
                              kind=FailureKind.DROPPED))
    assert state.set_stage(Stage.EVALUATE, StageState.RUNNING) is RunPhase.EVALUATING
    assert state.set_stage(Stage.EVALUATE, StageState.DONE) is RunPhase.COMPLETE_WITH_FAILURES  # one sample dropped
    assert state.meta()["evaluate_state"] == "done" and state.phase() is RunPhase.COMPLETE_WITH_FAILURES


def test_a_stage_move_the_phase_cannot_make_writes_nothing(redis_conn, data_dir):
    state = RunState(redis_conn, data_dir, "early")
    state.register(4, state="generating")
    with pytest.raises(IllegalTransition, match="'generating' -> 'evaluating'"):
        state.set_stage(Stage.TRAIN, StageState.DONE)
    assert "train_state" not in state.meta() and state.phase() is RunPhase.GENERATING
    with pytest.raises(ValueError, match="per-sample"):
        state.set_stage(Stage.EXTRACT, StageState.RUNNING)


def test_a_failed_runs_job_running_again_takes_back_its_finished_record(redis_conn, data_dir):
    state = _training(RunState(redis_conn, data_dir, "again"))
    state.paths.root.mkdir(parents=True)
    assert state.set_stage(Stage.TRAIN, StageState.FAILED, train_error="OSError: no space") is RunPhase.FAILED
    write_finished(state, RunPhase.FAILED)
    assert read_finished(state.paths)["state"] == "failed" and "finished_at" in state.meta()
    assert state.set_stage(Stage.TRAIN, StageState.RUNNING) is RunPhase.TRAINING
    assert read_finished(state.paths) is None and "finished_at" not in state.meta()
