"""The controller's loop over runs: keep each run's generate window full, hand settled runs to training.

A sample is *settled* when it can no longer change without an operator: generation failed or dropped
it, or extraction finished or failed it. When every expected sample is settled, the run's train job is
enqueued exactly once; from then on the trainer owns the run's whole-run stages.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from rq.exceptions import DuplicateJobError

from services.controller.feeder import FAILURE_TTL_S, RESULT_TTL_S, feed_finished, feed_run
from shared.jobs import TRAIN_FUNC, TRAIN_QUEUE, TrainJob, train_job_id
from shared.queues import queue
from shared.runstate import RunState, known_runs
from shared.settings import ControllerSettings

log = logging.getLogger(__name__)

SAMPLE_PHASES = ("queued", "generating", "extracting")
TRAIN_JOB_TIMEOUT = -1  # RQ's "never": training runs for hours and reports its own progress


def settled(state: RunState) -> tuple[int, int]:
    """(settled samples, samples extracted) of a run."""
    gen, ext = state.counts("generate"), state.counts("extract")
    return gen.failed + gen.dropped + ext.done + ext.failed + ext.dropped, ext.done


def enqueue_train(conn: redis.Redis, run: str) -> bool:
    """Enqueue the run's train job; False when a job with its id already exists."""
    try:
        queue(TRAIN_QUEUE, conn).enqueue_call(
            TRAIN_FUNC, args=(TrainJob(run=run).model_dump(mode="json"),), job_id=train_job_id(run),
            timeout=TRAIN_JOB_TIMEOUT, result_ttl=RESULT_TTL_S, failure_ttl=FAILURE_TTL_S, unique=True,
        )
    except DuplicateJobError:
        return False
    return True


def advance(state: RunState, meta: dict[str, str]) -> None:
    """Move a run from its sample stages to training once every expected sample is settled."""
    expected = int(meta.get("expected", 0))
    gen = state.counts("generate")
    done, extracted = settled(state)
    if done < expected:
        generated = gen.done + gen.failed + gen.dropped >= expected
        if meta.get("state") == "generating" and feed_finished(meta) and generated:
            state.set_meta(state="extracting")
        return
    if extracted == 0:
        state.set_meta(state="failed", error="no sample made it through extraction; nothing to train on")
        log.error("run %s: every sample failed before training", state.run)
        return
    if enqueue_train(state.conn, state.run):
        log.info("run %s: all %d samples settled (%d extracted); train job enqueued", state.run, expected, extracted)
    state.set_meta(state="training", train_enqueued_at=time.time())


def supervise_run(settings: ControllerSettings, conn: redis.Redis, run: str) -> None:
    state = RunState(conn, settings.data, run)
    meta = state.meta()
    if meta.get("state", "queued") not in SAMPLE_PHASES or "train_enqueued_at" in meta:
        return
    feed_run(settings, conn, run)
    advance(state, state.meta())


def supervise_once(settings: ControllerSettings, conn: redis.Redis) -> None:
    """One pass over every known run; a broken run is logged and the others still advance."""
    for run in known_runs(conn):
        try:
            supervise_run(settings, conn, run)
        except Exception:  # noqa: BLE001 - the loop's outer boundary: one run's bug never stalls the rest
            log.exception("run %s: supervision failed", run)


def supervise_forever(settings: ControllerSettings, conn: redis.Redis, stop: threading.Event) -> None:
    """Call ``supervise_once`` every ``feed_interval_s`` until ``stop`` is set; survive any error."""
    log.info("supervisor: every %.1fs", settings.feed_interval_s)
    while not stop.is_set():
        try:
            supervise_once(settings, conn)
        except Exception:  # noqa: BLE001 - Redis down, say: log and try again next tick
            log.exception("supervisor pass failed; retrying in %.1fs", settings.feed_interval_s)
        stop.wait(settings.feed_interval_s)
    log.info("supervisor: stopped")
