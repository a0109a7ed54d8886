"""An online run's spool (runtime.spool) and its budget in the extractions' claims (runtime.disk_claims): a file
released leaves the counts once, a resync makes them the volume's, a claim past the budget waits without pausing
the run until files go, and the sample the trainer waits for passes. Real Redis, real files."""

from __future__ import annotations

import threading
import time

import numpy as np
from safetensors.numpy import save_file

from runtime import disk, spool
from runtime.disk_claims import claim_space
from runtime.runstate import RunState
from shared.lifecycle import Outcome, RunKeys, Stage
from shared.runspec import OnlineConfig, RunSpec
from tests.runtime.test_disk import RUN, land, make_run


def online_run(data, conn, budget: int) -> RunState:
    state = make_run(data, conn, expected=10)
    spec = RunSpec.load(data, RUN)
    spec.model_copy(update={"online": OnlineConfig(enabled=True, budget_bytes=budget)}).save(data)
    return state


def write_file(state: RunState, sample_id: int, tokens: int) -> int:
    path = state.paths.hidden(sample_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": np.zeros(tokens, dtype=np.int64)}, str(path))
    nbytes = path.stat().st_size
    land(state, sample_id, nbytes, tokens)
    return nbytes


def done_ids(state: RunState) -> list[int]:
    return [i for i in range(10) if state.is_done(Stage.EXTRACT, i)]


def test_a_released_file_leaves_the_volume_and_the_counts_once(data_dir, redis_conn):
    state = online_run(data_dir, redis_conn, 10**6)
    sizes = {i: write_file(state, i, 10 * (i + 1)) for i in range(3)}
    assert spool.spool_bytes(redis_conn, RUN) == sum(sizes.values())
    assert spool.release(state, 1) == sizes[1]
    assert spool.release(state, 1) == 0  # gone already: nothing counted twice
    assert not state.paths.hidden(1).exists() and done_ids(state) == [0, 2]
    meta = state.meta()
    assert float(meta[disk.HIDDEN_BYTES]) == sizes[0] + sizes[2] and float(meta[disk.HIDDEN_TOKENS]) == 10 + 30
    assert meta[spool.ONLINE_RELEASED] == "1"
    assert spool.release(state, 2, counter=spool.ONLINE_EVICTED) == sizes[2]  # let go unread: counted apart
    meta = state.meta()
    assert meta[spool.ONLINE_RELEASED] == "1" and meta[spool.ONLINE_EVICTED] == "1" and done_ids(state) == [0]


def test_files_released_together_leave_the_counts_each_once(data_dir, redis_conn):
    state = online_run(data_dir, redis_conn, 10**6)
    sizes = {i: write_file(state, i, 10 * (i + 1)) for i in range(4)}
    state.paths.hidden(3).unlink()  # gone behind the spool's back: its bit goes, its bytes stay until a resync
    assert spool.release_many(state, [0, 2, 3]) == sizes[0] + sizes[2]
    assert done_ids(state) == [1] and not state.paths.hidden(0).exists() and not state.paths.hidden(2).exists()
    meta = state.meta()
    assert float(meta[disk.HIDDEN_BYTES]) == sizes[1] + sizes[3] and float(meta[disk.HIDDEN_TOKENS]) == 20 + 40
    assert meta[spool.ONLINE_RELEASED] == "3"
    assert spool.release_many(state, [0, 2]) == 0 and state.meta()[spool.ONLINE_RELEASED] == "3"  # once each
    assert spool.release_many(state, []) == 0


def test_a_resync_makes_the_counts_those_of_the_files_on_the_volume(data_dir, redis_conn):
    state = online_run(data_dir, redis_conn, 10**6)
    sizes = {i: write_file(state, i, 20) for i in range(4)}
    state.paths.hidden(2).unlink()  # a trainer killed between a deletion and its count
    redis_conn.setbit(RunKeys(RUN).outcome(Stage.EXTRACT, Outcome.DONE), 7, 1)  # a bit no file backs
    found = spool.resync(state, range(10))
    assert sorted(found) == [0, 1, 3] and done_ids(state) == [0, 1, 3]
    assert float(state.meta()[disk.HIDDEN_BYTES]) == sizes[0] + sizes[1] + sizes[3]


def test_a_claim_past_the_budget_waits_unpaused_until_the_trainer_frees_a_file(data_dir, redis_conn):
    state = online_run(data_dir, redis_conn, budget=3000)
    first = write_file(state, 0, 100)  # about 900 bytes a file, measured
    write_file(state, 1, 100)
    per_token = float(state.meta()[disk.HIDDEN_BYTES]) / 200
    need = int(100 * per_token)
    assert 2 * first + need <= 3000 < 3 * first + need  # a third file fits, a fourth does not
    with claim_space(redis_conn, data_dir, RUN, 2, 100, budget=3000) as claimed:
        assert claimed == need
    write_file(state, 2, 100)
    granted = threading.Event()

    def fourth() -> None:
        with claim_space(redis_conn, data_dir, RUN, 3, 100, budget=3000, poll_s=0.05):
            granted.set()

    waiter = threading.Thread(target=fourth)
    waiter.start()
    time.sleep(1.0)
    assert not granted.is_set()
    assert disk.paused_reason(redis_conn, RUN) is None  # the budget holds it back, not a full disk
    assert time.time() - float(state.meta()[spool.ONLINE_REFUSED_AT]) < 1.0
    spool.release(state, 0)
    waiter.join(timeout=10)
    assert granted.is_set() and float(state.meta()[spool.ONLINE_BLOCKED_S]) >= 0.9


def test_the_sample_the_trainer_waits_for_passes_a_full_budget(data_dir, redis_conn):
    state = online_run(data_dir, redis_conn, budget=2000)
    write_file(state, 0, 100)
    write_file(state, 1, 100)
    state.set_meta(**{spool.ONLINE_HEAD: 5})
    with claim_space(redis_conn, data_dir, RUN, 5, 100, budget=2000, poll_s=0.05) as claimed:
        assert claimed > 0  # the spool is full, and the trainer waits for this one


def test_a_claim_the_budget_keeps_refusing_gives_its_worker_back(data_dir, redis_conn):
    import pytest

    from runtime.disk_claims import DEFER_AFTER_S, BudgetDeferred

    state = online_run(data_dir, redis_conn, budget=2000)
    write_file(state, 0, 100)
    write_file(state, 1, 100)
    started = time.monotonic()
    with pytest.raises(BudgetDeferred, match="budget"):
        with claim_space(redis_conn, data_dir, RUN, 6, 100, budget=2000, poll_s=0.05):
            pass
    assert DEFER_AFTER_S <= time.monotonic() - started < DEFER_AFTER_S + 2
    assert redis_conn.hlen(RunKeys(RUN).disk_claims) == 0 and not state.is_done(Stage.EXTRACT, 6)


def test_a_later_sample_leaves_the_room_kept_for_the_batch_the_trainer_waits_for(data_dir, redis_conn):
    import pytest

    from runtime.disk_claims import BudgetDeferred

    state = online_run(data_dir, redis_conn, budget=3000)
    write_file(state, 0, 100)  # about 900 bytes a file: two more fit the budget
    state.set_meta(**{spool.ONLINE_BATCH: "4,5", spool.ONLINE_RESERVE: 1800})  # the next step's two missing files
    with pytest.raises(BudgetDeferred):  # a sample asked for ahead would take their room
        with claim_space(redis_conn, data_dir, RUN, 7, 100, budget=3000, poll_s=0.05):
            pass
    # Not a full budget: the trainer has nothing to release for it, and is not told so.
    assert spool.ONLINE_REFUSED_AT not in state.meta() and float(state.meta()[spool.ONLINE_BLOCKED_S]) >= 2
    with claim_space(redis_conn, data_dir, RUN, 5, 100, budget=3000, poll_s=0.05) as claimed:
        assert claimed > 0  # one of the batch's: the room is its own
    state.set_meta(**{spool.ONLINE_BATCH: "", spool.ONLINE_RESERVE: 0})  # the batch is in: later samples go on
    with claim_space(redis_conn, data_dir, RUN, 7, 100, budget=3000, poll_s=0.05) as claimed:
        assert claimed > 0
