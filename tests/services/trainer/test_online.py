"""The online trainer's plan and order (services/trainer/online.py): which samples it trains, in which seeded order,
what it asks for ahead, and what it keeps after a checkpoint. The real extraction meets it in tests/test_online.py."""

from __future__ import annotations

from collections import Counter

import pytest

from runtime.runstate import RunState
from services.trainer.online import Feed, OnlinePlanError, load_plan, make_plan, online_epoch_plan
from shared.atomic import atomic_write_json
from shared.jobs import extract_job_id
from shared.layout import RunPaths
from shared.lifecycle import Stage
from shared.runspec import OnlineConfig, RunSpec, TrainConfig

RUN = "plan"


def spec_of(rows: int, **train) -> RunSpec:
    return RunSpec(name=RUN, dataset="d.jsonl", model="m", rows=rows, train_ids=rows, train=TrainConfig(**train),
                   online=OnlineConfig(enabled=True, budget_bytes=10**6))


def with_replies(data, ids, failed=()) -> RunPaths:
    paths = RunPaths(data, RUN)
    for i in ids:
        atomic_write_json(paths.generated(i), {"sample_id": i})
    for i in failed:
        atomic_write_json(paths.failure(Stage.EXTRACT, i), {"sample_id": i})
    return paths


def test_the_plan_is_the_samples_with_a_reply_less_the_held_out_and_is_kept(data_dir):
    paths = with_replies(data_dir, [i for i in range(20) if i not in (3, 7)], failed=[11])
    spec = spec_of(20, validation_files=2)
    plan = make_plan(paths, spec)
    assert len(plan.validation_ids) == 2 and not set(plan.validation_ids) & set(plan.train_ids)
    assert sorted(plan.train_ids + plan.validation_ids) == [i for i in range(20) if i not in (3, 7, 11)]
    kept = load_plan(paths, spec, rank=0)  # written on the first start
    with_replies(data_dir, [3])  # a reply that lands later changes nothing: the plan is what training started with
    assert load_plan(paths, spec, rank=1) == kept


def test_a_run_without_replies_has_no_plan(data_dir):
    with pytest.raises(OnlinePlanError, match="no sample has a reply"):
        make_plan(RunPaths(data_dir, RUN), spec_of(5))


@pytest.mark.parametrize("world", [1, 2])
def test_each_epoch_is_a_seeded_order_holding_every_sample_once(world):
    cfg = TrainConfig(batch_size=3, seed=7)
    epochs = [online_epoch_plan(cfg, 20, epoch, world) for epoch in range(3)]
    for batches in epochs:
        assert Counter(i for batch in batches for i in batch) == Counter(range(20))
        assert all(len(batch) == 3 * world for batch in batches[:-1])
    assert epochs[0] != epochs[1]  # another order each epoch
    assert online_epoch_plan(cfg, 20, 1, world) == epochs[1]  # the same after a resume
    assert online_epoch_plan(TrainConfig(batch_size=3, seed=8), 20, 1, world) != epochs[1]


def feed_of(data_dir, redis_conn, samples: int = 10, epochs: int = 2, failed: set[int] = frozenset()) -> Feed:
    paths = with_replies(data_dir, range(samples))
    plan = make_plan(paths, spec_of(samples))
    cfg = TrainConfig(batch_size=4)
    feed = Feed(RunState(redis_conn, data_dir, RUN), plan, [online_epoch_plan(cfg, samples, e, 1) for e in range(epochs)],
                rank=0, budget=10**6)
    feed.failed |= set(failed)
    return feed


def test_what_comes_next_crosses_into_the_next_epoch_and_skips_failed_samples(data_dir, redis_conn):
    feed = feed_of(data_dir, redis_conn, failed={4})
    order = [[feed.plan.train_ids[i] for i in batch] for batch in feed.plans[0]]
    rest = [i for batch in order[2:] for i in batch if i != 4]
    following = [feed.plan.train_ids[i] for i in feed.plans[1][0] if feed.plan.train_ids[i] != 4]
    assert feed.upcoming(0, 2, 100)[: len(rest) + 2] == rest + following[:2]
    assert feed.upcoming(1, len(feed.plans[1]), 5) == []  # nothing after the last epoch


def test_after_a_checkpoint_the_files_read_go_unless_read_again_soon(data_dir, redis_conn, monkeypatch):
    import services.trainer.online as online

    feed = feed_of(data_dir, redis_conn)
    released: list[int] = []
    monkeypatch.setattr(online, "release", lambda state, sample_id: released.append(sample_id))
    soon = feed.upcoming(1, 0, 1)[0]  # with no size measured yet, one batch ahead is asked for and kept
    feed.unreleased = {1, 2, 3, soon}
    feed.asked = {i: 0.0 for i in feed.unreleased}
    feed.released_after_checkpoint(1, 0, span=1)
    assert sorted(released) == sorted({1, 2, 3} - {soon})
    assert feed.unreleased == set() and set(feed.asked) == {soon}  # a released sample is asked for afresh


def test_a_file_is_ready_only_once_its_manifest_names_that_version_of_it(data_dir, redis_conn):
    import os

    import numpy as np
    from safetensors.numpy import save_file

    from shared.manifest import ManifestEntry, append_entry, manifest_path

    feed = feed_of(data_dir, redis_conn)
    path = feed.paths.hidden(3)
    path.parent.mkdir(parents=True, exist_ok=True)
    from shared import eagle3

    save_file({eagle3.INPUT_IDS: np.zeros(4, dtype=np.int64), eagle3.LOSS_MASK: np.ones(4, dtype=np.uint8),
               eagle3.LAST_HIDDEN: np.zeros((4, 2), dtype=np.float32)}, str(path),
              metadata={eagle3.META_LAYER_IDS: "[0]"})
    assert not feed.ready(3)  # landed, not yet verified and recorded by its extractor

    def record(mtime_ns: int, at: float) -> None:
        append_entry(manifest_path(feed.paths, 3), ManifestEntry(3, "0" * 64, path.stat().st_size, 4, "F32", [0], at,
                                                                mtime_ns))

    record(path.stat().st_mtime_ns, at=0.0)  # an extractor whose clock runs far behind the file server's
    assert not feed.ready(3)  # verified and recorded, not yet counted: released now, it would be counted once gone
    feed.state.mark_done(Stage.EXTRACT, 3)
    assert feed.ready(3)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # extracted again, next epoch
    assert not feed.ready(3)  # the entry names the earlier version, however late its clock says it was written
    record(path.stat().st_mtime_ns, at=0.0)
    assert feed.ready(3)


def land_ready(feed: Feed, sample_id: int, tokens: int) -> int:
    """A verified, recorded and counted file of ``tokens`` tokens for ``sample_id``, as an extractor leaves it."""
    import numpy as np
    from safetensors.numpy import save_file

    from runtime.disk import landed_counts
    from shared import eagle3
    from shared.manifest import ManifestEntry, append_entry, manifest_path

    path = feed.paths.hidden(sample_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({eagle3.INPUT_IDS: np.zeros(tokens, dtype=np.int64), eagle3.LOSS_MASK: np.ones(tokens, dtype=np.uint8),
               eagle3.LAST_HIDDEN: np.zeros((tokens, 2), dtype=np.float32)}, str(path),
              metadata={eagle3.META_LAYER_IDS: "[0]"})
    size = path.stat().st_size
    append_entry(manifest_path(feed.paths, sample_id), ManifestEntry(sample_id, "0" * 64, size, tokens, "F32", [0],
                                                                     0.0, path.stat().st_mtime_ns))
    feed.state.mark_done(Stage.EXTRACT, sample_id, landed=landed_counts(size, tokens))
    return size


def test_room_for_the_batch_waited_for_comes_from_the_farthest_unread_files(data_dir, redis_conn, caplog):
    from runtime import spool

    feed = feed_of(data_dir, redis_conn, samples=12)
    ahead = feed.upcoming(0, 1, 8)  # the next two batches, landed before the first batch's files
    sizes = {i: land_ready(feed, i, 20) for i in ahead}
    batch = feed.upcoming(0, 0, 4)
    sizes[batch[0]] = land_ready(feed, batch[0], 20)  # one file of the batch waited for is there, three are not
    feed.unreleased = {ahead[0]}  # read by a step (not in a checkpoint yet): never the trainer's to delete unread
    largest = max(sizes.values())
    feed.budget = sum(sizes.values()) - 2 * largest  # full, and then some
    feed.make_room(set(batch), 0, 1)
    room = feed.budget - spool.spool_bytes(redis_conn, RUN)
    assert 0 <= room < largest  # within the budget again: the head passes it by one file at most
    gone = [i for i in ahead if not feed.paths.hidden(i).exists()]
    assert gone == ahead[-2:]  # the farthest ahead went first, no more than bring the spool within its budget
    assert feed.paths.hidden(batch[0]).exists() and feed.paths.hidden(ahead[0]).exists()
    assert feed.evicted == set(gone) and spool.online_status(feed.state, feed.state.meta(), feed.budget).evicted == 2
    feed.ask(gone, ahead=True)  # not asked for ahead again while the batch they made room for is incomplete
    assert not any(redis_conn.exists(f"rq:job:{extract_job_id(RUN, i)}") for i in gone)
    feed.ask(gone[:1])  # waited for, though: asked
    assert redis_conn.exists(f"rq:job:{extract_job_id(RUN, gone[0])}")

    feed.budget = sizes[batch[0]] // 2  # the batch's own files exceed the budget: nothing of it goes, said once
    with caplog.at_level("WARNING"):
        feed.make_room(set(batch), 0, 0)
        feed.make_room(set(batch), 0, 0)
    assert feed.paths.hidden(batch[0]).exists()
    assert sum("exceed online.budget_bytes" in r.message for r in caplog.records) == 1


def test_the_budget_keeps_room_for_the_files_the_next_step_misses(data_dir, redis_conn):
    from runtime import spool

    feed = feed_of(data_dir, redis_conn)
    feed.mean_bytes = 1000.0
    feed.keep_room([3, 8])
    meta = feed.state.meta()
    assert meta[spool.ONLINE_BATCH] == "3,8" and int(meta[spool.ONLINE_RESERVE]) == 2000
    feed.keep_room([])  # all in: nothing kept
    meta = feed.state.meta()
    assert meta[spool.ONLINE_BATCH] == "" and int(meta[spool.ONLINE_RESERVE]) == 0


def test_a_file_no_manifest_entry_names_and_no_job_holds_goes_and_is_asked_for_again(data_dir, redis_conn):
    import os
    import time

    from runtime.sample_queue import enqueue_extract
    from services.trainer.online import LOST_CHECK_S

    feed = feed_of(data_dir, redis_conn)
    land_ready(feed, 3, 20)
    land_ready(feed, 5, 20)
    for sample_id in (3, 5):  # rewritten by an extraction whose worker then lost Redis: the entry names the old file
        path = feed.paths.hidden(sample_id)
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert not feed.ready(3) and not feed.ready(5)
    enqueue_extract(redis_conn, RUN, [5], batch=1)  # an extraction of 5 is queued: its job will set the file right
    feed.clear_orphans([3, 5])
    assert feed.paths.hidden(3).exists()  # not yet: its extractor may be about to record it
    feed.unready_since = {i: time.monotonic() - LOST_CHECK_S for i in (3, 5)}
    feed.clear_orphans([3, 5])
    assert not feed.paths.hidden(3).exists() and not feed.state.is_done(Stage.EXTRACT, 3)
    assert feed.paths.hidden(5).exists()
    feed.ask([3])
    assert redis_conn.exists(f"rq:job:{extract_job_id(RUN, 3)}")
