"""The controller's loop over runs: rebuild what Redis lost, feed each run, hand settled runs to training,
and mark finished runs on the volume.

A sample is *settled* when it can no longer change without an operator: generation failed or dropped
it, or extraction finished or failed it. When every expected sample is settled, the run's train job is
enqueued exactly once; from then on the trainer owns the run's whole-run stages. When the run reaches
complete, complete_with_failures or failed, ``runs/<run>/state.json`` marks it finished on the volume.

Every pass first looks for runs on the volume that are not finished there but that Redis does not know
(a flushed or restarted Redis), and rebuilds them with ``reconcile_run``: the volume is the truth. It
then requeues the jobs of dead workers (``reaper``) and names the samples of jobs RQ failed, so no
sample is stuck in a job nobody runs.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from services.controller.loop.failures import name_failed_jobs
from services.controller.loop.feeder import (
    backfill_extract,
    feed_finished,
    feed_run,
)
from services.controller.loop.reaper import requeue_abandoned
from services.controller.loop.reconcile import (
    NO_PROMPTS_BACKOFF_S,
    REBUILD_BACKOFF_S,
    NoPromptList,
    back_off,
    lost_runs,
    reconcile_run,
    reconciling,
    remove_stale_temps,
)
from runtime.runstate import RunState, known_runs, write_finished
from shared.atomic import temp_files
from shared.errors import RunNotFound
from runtime.disk import supervise_disk
from shared.lifecycle import SAMPLE_PHASES, SAMPLE_STAGES, Outcome, RunPhase, Stage
from runtime.outage import REDIS_DOWN, RedisOutage
from runtime.sample_queue import enqueue_train
from shared.runspec import cached_spec
from shared.settings import ControllerSettings

log = logging.getLogger(__name__)

def settled(state: RunState) -> tuple[int, int]:
    """(settled samples, samples extracted) of a run; a sample counts once whatever its bitmaps say."""
    run_keys = state.keys
    extracted = run_keys.outcome(Stage.EXTRACT, Outcome.DONE)
    keys = [run_keys.outcome(stage, outcome) for stage in SAMPLE_STAGES for outcome in (Outcome.FAILED, Outcome.DROPPED)]
    keys.append(extracted)
    scratch = run_keys.settled_scratch
    pipe = state.conn.pipeline()
    pipe.bitop("OR", scratch, *keys)
    pipe.bitcount(scratch)
    pipe.delete(scratch)
    pipe.bitcount(extracted)
    _, count, _, extracted = pipe.execute()
    return count, extracted


def advance(state: RunState, meta: dict[str, str]) -> None:
    """Move a run from its sample stages to training once every expected sample is settled."""
    expected = int(meta.get("expected", 0))
    if cached_spec(state.paths.data, state.run).online.enabled:
        advance_online(state, expected)
        return
    done, extracted = settled(state)
    if done < expected:
        generated = state.counts(Stage.GENERATE).settled >= expected
        if RunPhase.of(meta.get("state")) is RunPhase.GENERATING and feed_finished(meta) and generated:
            state.set_phase(RunPhase.EXTRACTING)
        return
    if extracted == 0:
        state.set_phase(RunPhase.FAILED, error="no sample made it through extraction; nothing to train on")
        log.error("run %s: every sample failed before training", state.run)
        return
    # Every sample is settled, so any temp file left in the sample stages is a killed writer's debris.
    if removed := remove_stale_temps(state.paths, cutoff=time.time()):
        log.info("run %s: removed %d temp files left by killed writers", state.run, removed)
    if enqueue_train(state.conn, state.run):
        log.info("run %s: all %d samples settled (%d extracted); train job enqueued", state.run, expected, extracted)
    state.set_phase(RunPhase.TRAINING, train_enqueued_at=time.time())


def advance_online(state: RunState, expected: int) -> None:
    """An online run trains once generation has settled: its trainer then asks for each sample's states in its
    own order (services/trainer/online.py), so extraction is not a phase of its own."""
    generate = state.counts(Stage.GENERATE)
    if generate.settled < expected:
        return
    if generate.done == 0:
        state.set_phase(RunPhase.FAILED, error="no sample made it through generation; nothing to train on")
        log.error("run %s: every sample failed before training", state.run)
        return
    if enqueue_train(state.conn, state.run):
        log.info("run %s: generation settled (%d replies of %d); online train job enqueued", state.run,
                 generate.done, expected)
    state.set_phase(RunPhase.TRAINING, train_enqueued_at=time.time())


def finish(state: RunState, meta: dict[str, str]) -> None:
    """Mark a run that reached a terminal phase as finished on the volume (once)."""
    if "finished_at" in meta:
        return
    final = RunPhase.of(meta.get("state"))  # the trainer's jobs move the phase as they end (RunState.set_stage)
    if final.terminal:
        for debris in temp_files(state.paths.root):  # no writer of this run remains; a finished run has none
            debris.unlink(missing_ok=True)
        write_finished(state, final)
        log.info("run %s: finished as %s", state.run, final)


def supervise_run(settings: ControllerSettings, conn: redis.Redis, run: str) -> None:
    if reconciling(conn, run):
        return  # a resume is rebuilding this run's state; feeding now would read half-written bitmaps
    state = RunState(conn, settings.data, run)
    if not state.paths.spec.is_file():  # submission writes run.json before Redis hears of the run
        raise RunNotFound(f"{state.paths.spec} does not exist")
    meta = state.meta()
    if RunPhase.of(meta.get("state")) in SAMPLE_PHASES and "train_enqueued_at" not in meta:
        # A run projected to outgrow the volume stops taking new prompts; extraction waits in the workers.
        if supervise_disk(settings, state).ok:
            feed_run(settings, state)
        backfill_extract(settings, state)
        advance(state, state.meta())
    else:
        if RunPhase.of(meta.get("state")) == RunPhase.TRAINING and cached_spec(settings.data, run).online.enabled:
            # An online run extracts while it trains: a claim the full volume refused pauses the run, and this
            # check lifts the pause once the space is back.
            supervise_disk(settings, state)
        finish(state, meta)


def rebuild_lost(settings: ControllerSettings, conn: redis.Redis) -> None:
    """Reconcile every unfinished run on the volume that Redis has lost."""
    for run in lost_runs(settings.data, conn):
        log.warning("run %s: on the volume but lost by Redis; rebuilding its state from the volume", run)
        try:
            report = reconcile_run(settings.data, conn, run)
        except REDIS_DOWN:
            raise
        except NoPromptList as exc:  # a known condition, not a bug: one line, no traceback
            log.warning("%s; looking again in %.0fs", exc, NO_PROMPTS_BACKOFF_S)
            back_off(conn, run, NO_PROMPTS_BACKOFF_S)
            continue
        except Exception:  # noqa: BLE001 - one run that cannot be rebuilt must not stall the others
            log.exception("run %s: rebuilding failed; trying again in %.0fs", run, REBUILD_BACKOFF_S)
            back_off(conn, run)
            continue
        log.warning("run %s: rebuilt: %s", run, report.summary())


def housekeeping(settings: ControllerSettings, conn: redis.Redis) -> None:
    """Before feeding: rebuild lost runs, requeue dead workers' jobs, name the samples of failed jobs."""
    steps = (("rebuilding lost runs", lambda: rebuild_lost(settings, conn)),
             ("requeueing abandoned jobs", lambda: requeue_abandoned(conn)),
             ("naming failed jobs", lambda: name_failed_jobs(settings.data, conn)))
    for what, step in steps:
        try:
            step()
        except REDIS_DOWN:
            raise  # Redis is gone: the whole pass waits for it
        except Exception:  # noqa: BLE001 - one broken step must not stop feeding
            log.exception("supervisor: %s failed", what)


def supervise_once(settings: ControllerSettings, conn: redis.Redis, absent: set[str] | None = None) -> None:
    """One pass over every known run; a broken run is logged and the others still advance.

    ``absent`` holds the runs already reported as known to Redis but missing from this volume, so a loop that
    passes the same set names each of them once, not once a tick."""
    absent = set() if absent is None else absent
    housekeeping(settings, conn)
    for run in known_runs(conn):
        try:
            supervise_run(settings, conn, run)
            absent.discard(run)
        except REDIS_DOWN:
            raise  # not this run's fault: the whole pass waits for Redis
        except RunNotFound as exc:
            # Redis names a run this volume does not hold: another volume's controller shares this Redis, or the
            # run's directory was removed. Nothing here can feed it, and nothing here may delete its state.
            if run not in absent:
                absent.add(run)
                log.warning("run %s: known to Redis but not on this controller's volume (%s); is Redis shared with "
                            "another volume's controller? leaving it alone", run, exc)
        except Exception:  # noqa: BLE001 - the loop's outer boundary: one run's bug never stalls the rest
            log.exception("run %s: supervision failed", run)


def supervise_forever(settings: ControllerSettings, conn: redis.Redis, stop: threading.Event) -> None:
    """Call ``supervise_once`` every ``feed_interval_s`` until ``stop`` is set; survive any error."""
    log.info("supervisor: every %.1fs", settings.feed_interval_s)
    outage = RedisOutage("controller supervisor")
    absent: set[str] = set()
    while not stop.is_set():
        try:
            supervise_once(settings, conn, absent)
            outage.up()
        except REDIS_DOWN as exc:
            outage.down(exc)  # logged once per outage; the next tick tries again
        except Exception:  # noqa: BLE001 - the loop's outer boundary: log and try again next tick
            log.exception("supervisor pass failed; retrying in %.1fs", settings.feed_interval_s)
        stop.wait(settings.feed_interval_s)
    log.info("supervisor: stopped")
