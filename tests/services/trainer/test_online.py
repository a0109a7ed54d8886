"""The online trainer's feed (services/trainer/online.py): which samples it asks for ahead and in which order,
what it keeps after each step, how it makes room, and what it estimates a file's size as. The plan it reads is
pinned in test_online_plan.py; the real extraction meets both in tests/test_online.py."""

from __future__ import annotations

import pytest

from runtime import spool
from runtime.runstate import RunState
from services.trainer.batching import LENGTH
from services.trainer.online import ASK_AGAIN_S, Feed, OnlineBudgetTooSmall, Rates, SizeModel
from services.trainer.online_plan import OnlinePlan
from services.trainer.sources import epoch_plan
from shared.jobs import extract_job_id
from shared.lifecycle import Stage
from shared.runspec import TrainConfig
from tests.support.spool_files import land

RUN = "plan"


def feed_of(data_dir, redis_conn, samples: int = 10, epochs: int = 2, failed=frozenset(), tokens=None,
            budget: int = 10**6, batch_size: int = 4) -> Feed:
    tokens = tokens or [20 + 3 * i for i in range(samples)]
    plan = OnlinePlan(list(range(samples)), [], tokens)
    cfg = TrainConfig(batch_size=batch_size)
    plans = [epoch_plan(cfg, tokens, e, 1, LENGTH) for e in range(epochs)]
    feed = Feed(RunState(redis_conn, data_dir, RUN), plan, plans, rank=0, budget=budget, span=batch_size)
    feed.failed |= set(failed)
    return feed


def land_ready(feed: Feed, sample_id: int, tokens: int) -> int:
    """A verified, recorded and counted file of ``tokens`` tokens for ``sample_id``, as an extractor leaves it."""
    return land(feed.state, sample_id, tokens)


def test_what_comes_next_crosses_into_the_next_epoch_and_skips_failed_samples(data_dir, redis_conn):
    feed = feed_of(data_dir, redis_conn, failed={4})
    order = [feed.batch_ids(0, i) for i in range(len(feed.plans[0]))]
    rest = [i for batch in order[2:] for i in batch if i != 4]
    following = [i for i in feed.batch_ids(1, 0) if i != 4]
    assert feed.upcoming(0, 2, 100)[: len(rest) + 2] == rest + following[:2]
    assert feed.upcoming(1, len(feed.plans[1]), 5) == []  # nothing after the last epoch


def test_a_files_size_is_fitted_from_the_files_landed_and_priced_before_any_from_the_submission_estimate():
    sizes = SizeModel(prior_per_token=100.0)
    assert sizes.estimate(10) == 1000.0  # nothing landed: the figure recorded at submission, no overhead
    for sample_id, tokens in enumerate((10, 40, 25)):
        sizes.add(sample_id, tokens, 512 + 37 * tokens)  # a header, then each token's states
    sizes.add(0, 10, 10**9)  # the same sample landing again (next epoch) is not a second measurement
    assert sizes.estimate(100) == pytest.approx(512 + 3700)
    assert sizes.mean_bytes == pytest.approx(512 + 37 * 25)
    assert SizeModel().estimate(10) is None  # nothing known at all


def test_the_window_asks_whole_batches_in_training_order_as_far_as_the_budget_holds(data_dir, redis_conn):
    feed = feed_of(data_dir, redis_conn, samples=16, epochs=1)
    feed.sizes.prior_per_token = 10.0  # bytes = 10 x tokens
    order = feed.upcoming(0, 0, 100)
    batches = [feed.batch_ids(0, i) for i in range(len(feed.plans[0]))]
    cost = [sum(10 * feed.tokens[s] for s in batch) for batch in batches]
    feed.held_bytes = 1000
    feed.budget = 1000 + cost[0] + cost[1] + 10 * feed.tokens[batches[2][0]]  # two batches and one more file
    window = feed.plan_window(0, 0)
    assert window.ids == order[: 2 * 4 + 1]  # a prefix of the order: no later sample before an earlier one fits
    assert window.steps == 2 and window.limit == spool.WindowLimit.BUDGET
    assert window.nbytes == cost[0] + cost[1] + 10 * feed.tokens[batches[2][0]]
    feed.budget = 1000  # nothing fits beside the held-out files: the batch waited for is asked for still
    assert feed.plan_window(0, 0).ids == batches[0]
    feed.budget = 10**9
    assert feed.plan_window(0, 2).ids == order[8:] and feed.plan_window(0, 2).limit == spool.WindowLimit.END


def test_measured_rates_shorten_the_window_to_the_steps_extraction_needs(data_dir, redis_conn):
    feed = feed_of(data_dir, redis_conn, samples=40, epochs=1)
    feed.sizes.prior_per_token = 10.0
    feed.rates = Rates(step_s=1.0, landed_per_s=8.0)  # a batch of 4 takes half a step to extract
    assert feed.rates.steps_ahead(4) == 1 + 2  # twice the half step, rounded up, and two more
    window = feed.plan_window(0, 0)
    assert window.steps == 3 and window.limit == spool.WindowLimit.RATES
    feed.rates = Rates(step_s=1.0, landed_per_s=2.0)  # extraction the slower side: only the budget bounds it
    assert feed.rates.steps_ahead(4) is None and feed.plan_window(0, 0).limit == spool.WindowLimit.END
    rates = Rates()
    rates.note_landed(0, busy=True, now=0.0)
    rates.note_landed(10, busy=False, now=1.0)  # extraction ran dry: that interval measured the asking
    assert rates.landed_per_s is None
    rates.note_landed(30, busy=True, now=2.0)
    assert rates.landed_per_s == 20.0


def test_after_a_step_its_files_go_unless_the_window_holds_them_again(data_dir, redis_conn, monkeypatch):
    import services.trainer.online as online

    feed = feed_of(data_dir, redis_conn, samples=8, epochs=2)
    feed.sizes.prior_per_token = 10.0
    released: list[int] = []
    monkeypatch.setattr(online, "release_many", lambda state, sample_ids, **kw: released.extend(sample_ids) or 0)
    last = len(feed.plans[0]) - 1
    read = feed.batch_ids(0, last)
    soon = feed.batch_ids(1, 0)  # the next epoch's first batch: asked for again at once
    feed.budget = 10 * sum(feed.tokens[s] for s in soon)  # the window holds that one batch
    feed.asked = {i: 0.0 for i in read}
    feed.after_step(0, last)
    assert sorted(released) == sorted(set(read) - set(soon))
    assert not set(released) & set(feed.asked)  # a released sample is asked for afresh when it comes round
    assert feed.window.ids == soon
    assert all(redis_conn.exists(f"rq:job:{extract_job_id(RUN, i)}") for i in soon)  # and asked for
    meta = feed.state.meta()
    assert int(meta[spool.ONLINE_WINDOW_FILES]) == len(soon) and meta[spool.ONLINE_WINDOW_LIMIT] == "budget"


def test_a_budget_that_cannot_hold_the_largest_batch_beside_the_held_out_files_fails_by_name(data_dir, redis_conn):
    feed = feed_of(data_dir, redis_conn, samples=12, epochs=1)
    feed.sizes.prior_per_token = 10.0
    largest = max(sum(10 * feed.tokens[s] for s in feed.batch_ids(0, i)) for i in range(len(feed.plans[0])))
    feed.held_bytes = 500
    feed.budget = 500 + largest
    feed.check_budget()  # just enough
    feed.budget -= 1
    with pytest.raises(OnlineBudgetTooSmall, match=f"at least {500 + largest:,} bytes are needed"):
        feed.check_budget()


def test_a_file_is_ready_only_once_its_manifest_names_that_version_of_it(data_dir, redis_conn):
    import os

    import numpy as np
    from safetensors.numpy import save_file

    from shared import eagle3
    from shared.manifest import ManifestEntry, append_entry, manifest_path

    feed = feed_of(data_dir, redis_conn)
    path = feed.paths.hidden(3)
    path.parent.mkdir(parents=True, exist_ok=True)
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


def test_a_version_found_ready_is_known_by_its_stat_and_one_let_go_is_looked_at_afresh(data_dir, redis_conn,
                                                                                        monkeypatch):
    import numpy as np
    from safetensors.numpy import save_file

    from shared import eagle3

    feed = feed_of(data_dir, redis_conn)
    land_ready(feed, 3, 30)
    assert feed.ready(3) and feed.on_volume(3)
    # The loop's thread looks at a batch's files at every step until it trains them: once verified, a stat does.
    monkeypatch.setattr(feed.state, "is_done", lambda *a: pytest.fail("a verified version is looked at again"))
    assert feed.ready(3)
    monkeypatch.undo()
    assert feed.let_go(3) > 0
    assert not feed.ready(3) and not feed.on_volume(3) and not feed.paths.hidden(3).exists()
    path = feed.paths.hidden(3)  # extracted again, but not yet recorded in its manifest nor counted
    save_file({eagle3.INPUT_IDS: np.zeros(30, dtype=np.int64), eagle3.LOSS_MASK: np.ones(30, dtype=np.uint8),
               eagle3.LAST_HIDDEN: np.zeros((30, 2), dtype=np.float32)}, str(path),
              metadata={eagle3.META_LAYER_IDS: "[0]"})
    assert feed.on_volume(3) and not feed.ready(3)


def test_a_file_deleted_behind_the_feeds_back_is_asked_for_again(data_dir, redis_conn):
    # A resume's reconcile deletes files that disagree with their manifest entry while the trainer runs: the feed
    # saw the file, so only a fresh look at the volume keeps the trainer from waiting for it for ever.
    feed = feed_of(data_dir, redis_conn)
    land_ready(feed, 4, 30)
    assert feed.on_volume(4) and feed.ready(4)
    feed.paths.hidden(4).unlink()
    assert not feed.ready(4)
    feed.asked[4] = -ASK_AGAIN_S  # asked long ago
    feed.ask([4])
    assert redis_conn.exists(f"rq:job:{extract_job_id(RUN, 4)}")


def test_room_for_the_batch_waited_for_comes_from_the_farthest_unread_files(data_dir, redis_conn, caplog):
    feed = feed_of(data_dir, redis_conn, samples=12)
    ahead = feed.upcoming(0, 1, 8)  # the next two batches, landed before the first batch's files
    sizes = {i: land_ready(feed, i, 20) for i in ahead}
    batch = feed.upcoming(0, 0, 4)
    sizes[batch[0]] = land_ready(feed, batch[0], 20)  # one file of the batch waited for is there, three are not
    feed.loading = {ahead[0]}  # a loader reads it now: never deleted under it
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
    feed = feed_of(data_dir, redis_conn)
    feed.sizes.prior_per_token = 10.0
    feed.keep_room([3, 8])
    meta = feed.state.meta()
    assert meta[spool.ONLINE_BATCH] == "3,8"
    assert int(meta[spool.ONLINE_RESERVE]) == 10 * (feed.tokens[3] + feed.tokens[8])  # each at its own size
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


def test_batches_are_capped_only_where_the_budget_could_not_hold_two_of_the_longest(data_dir, redis_conn):
    feed = feed_of(data_dir, redis_conn, samples=24, epochs=1)
    feed.sizes.prior_per_token = 10.0
    lengths = feed.plan.tokens
    largest = max(sum(10 * lengths[i] for i in batch) for batch in feed.plans[0])
    feed.budget = 2 * largest
    assert feed.batch_token_cap(feed.plans, lengths) is None  # two of the longest fit: batches stay offline's
    feed.budget = largest  # one of them at most
    cap = feed.batch_token_cap(feed.plans, lengths)
    assert cap == largest // 2 // 10
    capped = epoch_plan(TrainConfig(batch_size=4), lengths, 0, 1, LENGTH, cap_tokens=cap)
    assert max(sum(10 * lengths[i] for i in batch) for batch in capped) <= feed.budget / 2


def test_a_batch_that_settles_between_two_looks_is_taken_with_the_spool_full(data_dir, redis_conn, monkeypatch):
    # The H100 run of 2026-12-07 (budget 2%): the batch's last file landed between the look that found the batch
    # unsettled and the one that lists its missing files, with the spool full; tending nothing then failed the run.
    feed = feed_of(data_dir, redis_conn, samples=8)
    batch = feed.upcoming(0, 0, 4)
    sizes = [land_ready(feed, i, 20) for i in batch]
    feed.budget = sum(sizes) // 2  # full: tending would name the first missing file the one that may pass it
    assert feed.spool_full()
    looks = []
    settled = feed.settled

    def late_look(epoch: int, index: int) -> list[int] | None:
        looks.append(index)
        return None if len(looks) == 1 else settled(epoch, index)  # the first look still sees it unsettled

    monkeypatch.setattr(feed, "settled", late_look)
    assert [feed.plan.train_ids[i] for i in feed.wait_for(0, 0)] == batch
    assert all(feed.paths.hidden(i).exists() for i in batch)  # nothing deleted to make room for what is there
    assert feed.state.meta().get(spool.ONLINE_HEAD, "") == ""
