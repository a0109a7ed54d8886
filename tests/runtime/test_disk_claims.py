"""Claims on the volume (runtime.disk_claims): granted only while they fit beside the others, a refused one pauses
the run until the supervisor sees its need fit. Real Redis, a real size-limited tmpfs."""

from __future__ import annotations

import threading
import time

import pytest

from runtime import disk, spool
from runtime.disk_claims import bytes_per_token, claim_space
from runtime.shutdown import JobYielded
from runtime.runstate import RunState
from shared.lifecycle import RunKeys
from tests.runtime.test_disk import RUN, land, make_run, settings_for
from tests.runtime.test_spool import online_run, write_file
from tests.support.stopping import stop_in  # noqa: F401 - a fixture
from tests.support.tmpfs import mounted_tmpfs

VOLUME = 1 << 20
RESERVE = 128 << 10


def checked(state: RunState, reserve: int = RESERVE) -> disk.Headroom:
    return disk.supervise_disk(settings_for(state.paths.data, reserve), RunState(state.conn, state.paths.data, RUN))


def test_the_size_per_token_is_measured_once_files_land_and_estimated_before(data_dir, redis_conn):
    state = make_run(data_dir, redis_conn)
    assert bytes_per_token(redis_conn, RUN) == (None, "unknown")
    state.set_meta(**{disk.BYTES_PER_TOKEN_ESTIMATE: 50})
    assert bytes_per_token(redis_conn, RUN) == (50.0, "estimated")
    land(state, 0, 3000, 20)
    assert bytes_per_token(redis_conn, RUN) == (150.0, "measured")


def test_nothing_is_claimed_while_no_size_per_token_is_known(data_dir, redis_conn):
    make_run(data_dir, redis_conn)
    with claim_space(redis_conn, data_dir, RUN, 3, 10**9) as claimed:
        assert claimed == 0 and redis_conn.hlen(RunKeys(RUN).disk_claims) == 0


def test_claims_are_granted_while_they_fit_beside_the_others_and_dropped_after_the_write(tmp_path, redis_conn):
    with mounted_tmpfs(tmp_path / "volume", VOLUME) as fs:
        state = make_run(fs.path, redis_conn, expected=3)
        land(state, 0, 100_000, 1000)  # 100 bytes a token, measured
        assert checked(state, reserve=RESERVE).ok  # records the reserve the claims keep
        room = disk.volume_usage(fs.path)[0] - RESERVE
        first_tokens = room // 100 // 2
        with claim_space(redis_conn, fs.path, RUN, 1, first_tokens) as first:
            assert first == first_tokens * 100
            with claim_space(redis_conn, fs.path, RUN, 2, first_tokens, poll_s=0.05) as second:
                assert second == first
                assert disk.claimed_bytes(redis_conn, RUN) == 2 * first
            assert disk.claimed_bytes(redis_conn, RUN) == first
        assert disk.claimed_bytes(redis_conn, RUN) == 0
        assert disk.paused_reason(redis_conn, RUN) is None


def test_a_claim_that_does_not_fit_pauses_the_run_until_the_volume_grows(tmp_path, redis_conn):
    with mounted_tmpfs(tmp_path / "volume", VOLUME) as fs:
        state = make_run(fs.path, redis_conn, expected=3)
        land(state, 0, 100_000, 1000)
        assert checked(state).ok  # two more samples of ~100 KB fit: the supervisor alone would not pause
        room = disk.volume_usage(fs.path)[0] - RESERVE
        tokens = room // 100 + 10  # one sample longer than all the room there is
        granted = threading.Event()

        def extract() -> None:
            with claim_space(redis_conn, fs.path, RUN, 2, tokens, poll_s=0.05):
                granted.set()

        worker = threading.Thread(target=extract, daemon=True)
        worker.start()
        deadline = time.monotonic() + 10
        while disk.paused_reason(redis_conn, RUN) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        reason = disk.paused_reason(redis_conn, RUN)
        assert reason and "sample 2 needs" in reason and str(fs.path) in reason and "measured" in reason
        assert not granted.is_set()

        # The supervisor's projection fits, yet the claim's recorded need does not: the pause holds.
        headroom = checked(state)
        assert not headroom.ok and disk.paused_reason(redis_conn, RUN) == reason
        worker.join(0.3)
        assert not granted.is_set()

        fs.resize(16 << 20)
        assert checked(state).ok and disk.paused_reason(redis_conn, RUN) is None
        worker.join(10)
        assert granted.is_set() and not worker.is_alive()
        assert redis_conn.hget(RunKeys(RUN).meta, disk.PAUSED_NEED) is None


def test_concurrent_claims_never_promise_more_than_the_room(tmp_path, redis_conn):
    with mounted_tmpfs(tmp_path / "volume", VOLUME) as fs:
        state = make_run(fs.path, redis_conn, expected=4)
        land(state, 0, 100_000, 1000)
        assert checked(state).ok
        room = disk.volume_usage(fs.path)[0] - RESERVE
        tokens = room // 100 // 3 + 1  # three of these do not fit at once, two do
        release, peak = threading.Event(), []

        def extract(sample_id: int) -> None:
            with claim_space(redis_conn, fs.path, RUN, sample_id, tokens, poll_s=0.05):
                peak.append(disk.claimed_bytes(redis_conn, RUN))
                release.wait(10)

        workers = [threading.Thread(target=extract, args=(i,), daemon=True) for i in (1, 2, 3)]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + 10
        while disk.paused_reason(redis_conn, RUN) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert disk.paused_reason(redis_conn, RUN) is not None  # the third claim was refused
        assert disk.claimed_bytes(redis_conn, RUN) == 2 * tokens * 100 <= room
        release.set()
        fs.resize(16 << 20)
        deadline = time.monotonic() + 10
        while disk.paused_reason(redis_conn, RUN) is not None and time.monotonic() < deadline:
            checked(state)
            time.sleep(0.05)
        for worker in workers:
            worker.join(10)
        assert len(peak) == 3 and max(peak) <= room and disk.claimed_bytes(redis_conn, RUN) == 0


def test_the_supervisor_drops_the_claim_a_killed_worker_left_on_a_sample_now_done(data_dir, redis_conn):
    state = make_run(data_dir, redis_conn)
    redis_conn.hset(RunKeys(RUN).disk_claims, mapping={"4": 5000, "5": 7000})
    land(state, 4, 5000, 50)
    checked(state, reserve=0)
    assert redis_conn.hgetall(RunKeys(RUN).disk_claims) == {b"5": b"7000"}


def test_a_claim_waiting_for_room_in_the_online_budget_yields_once_the_worker_is_told_to_stop(data_dir, redis_conn,
                                                                                             stop_in):
    state = online_run(data_dir, redis_conn, budget=2000)
    write_file(state, 0, 100)  # about 900 bytes a file: a third does not fit the budget
    write_file(state, 1, 100)
    stop_in(0)
    with pytest.raises(JobYielded, match="sample 6 waited for room in the online budget"):
        with claim_space(redis_conn, data_dir, RUN, 6, 100, budget=2000, poll_s=0.05):
            pass
    assert redis_conn.hlen(RunKeys(RUN).disk_claims) == 0 and not state.is_done("extract", 6)
    assert spool.ONLINE_BLOCKED_S in state.meta()  # its time blocked is counted, as a deferred claim's is
