import pytest

from shared.runstate import DROPPED, Failure, RunState, known_runs


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
    state.mark_failed(Failure("r", "generate", 6, "ReplyTooShort", "2 < 8 tokens", kind=DROPPED))
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


def test_rate_counts_recent_completions(state):
    for sample in range(5):
        state.mark_done("extract", sample)
    assert state.rate("extract") > 0
    assert state.rate("generate") == 0.0


def test_unknown_stage_is_refused(state):
    with pytest.raises(ValueError):
        state.mark_done("train", 1)
