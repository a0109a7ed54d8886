"""Every failure of a run, named, and a way to run failed samples again (``draftline failures``/``retry``).

Failure records are read from the volume (``failures/<stage>/*.json``), which is the truth even when
Redis is gone. Retrying clears the chosen records, volume first and then Redis, and moves the feeder's
cursors back so it enqueues those samples again: a generate failure re-runs generation, an extract
failure re-runs extraction (and generation too when the sample's reply is gone). By default a retry
takes errors only; drops (replies too short) are taken when named by id or with ``include_dropped``.

An RQ job of a sample stage that RQ itself failed (its worker died too often, it ran past its timeout,
an error escaped it) leaves its samples unsettled; ``name_failed_jobs`` names each of them as a
``JobFailed`` failure of its stage and forgets the job, so they can be retried like any other.

A run whose training or evaluation failed (a full disk mid-checkpoint, a trainer out of memory) and that
has no sample failure to retry resumes that stage instead: its job is queued again, replacing the failed
one, and training picks up from its latest checkpoint (evaluation measures the export again). A run Redis
lost is rebuilt from the volume first, so this works after a Redis loss too.

Rows that were malformed at submission are not in ``prompts.jsonl`` and cannot be retried. A run that
is training or evaluating is refused. A finished run is reopened: its ``drafter/`` and ``eval.json``
move to ``superseded/<UTC time>/`` (nothing is deleted), and training starts afresh once the retried
samples settle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis
from rq.exceptions import NoSuchJobError
from rq.executions import ExecutionRegistry
from rq.job import Job
from rq.registry import FailedJobRegistry

from services.controller.loop.reconcile import (RunBusy, read_failure_file, reconcile_run, reconciling, reply_problem,
                                                run_ids)
from runtime.runstate import RunState, finished_path, read_finished
from shared.atomic import fsync_dir
from shared.errors import RunNotFound
from shared.jobs import EXTRACT_QUEUE, GENERATE_QUEUE, payload_sample_ids
from shared.layout import RunPaths
from shared.lifecycle import (SAMPLE_STAGES, WHOLE_RUN_STAGES, Failure, FailureKind, RunPhase, Stage, StageState,
                              phase_for_stage)
from runtime.queues import SERIALIZER, queue
from runtime.sample_queue import enqueue_evaluate, enqueue_train
from shared.runspec import RunSpec

log = logging.getLogger(__name__)

FAILURE_FIELDS = ("sample_id", "stage", "error_class", "message", "kind")
KEPT_META = {"train_ids"}  # starts like a training field, but describes the run's ids


def list_failures(data: Path, run: str, *, stage: str | None = None) -> list[Failure]:
    """The run's failure records on the volume, generate before extract, then by sample id."""
    paths = RunPaths(Path(data), run)
    if not paths.spec.is_file():
        raise RunNotFound(f"no run {run!r} under {Path(data) / 'runs'}")
    found = []
    for name in [stage] if stage else SAMPLE_STAGES:
        directory = paths.failures_dir / name
        for path in sorted(directory.glob("[0-9]*.json")) if directory.is_dir() else ():
            if path.stem.isdigit():
                found.append(read_failure_file(path, run, name, int(path.stem)))
    return found


def failure_dict(failure: Failure) -> dict:
    return {k: getattr(failure, k) for k in FAILURE_FIELDS}


def format_failures(run: str, failures: list[Failure]) -> str:
    if not failures:
        return f"run {run}: no failures"
    lines = [f"run {run}: {len(failures):,} failures"]
    lines += [f"  {f.stage:<8} sample {f.sample_id:<8} {f.kind:<7} {f.error_class}: {f.message}" for f in failures]
    return "\n".join(lines)


@dataclass
class RetryReport:
    run: str
    cleared: list[dict] = field(default_factory=list)  # {"sample_id", "stage"}: will run again
    not_retryable: list[dict] = field(default_factory=list)  # {"sample_id", "stage", "reason"}
    unknown: list[int] = field(default_factory=list)  # ids asked for without a matching failure record
    superseded: str | None = None  # where a finished run's drafter and evaluation went
    resumed: dict | None = None  # {"stage", "checkpoint_step"}: a failed train or evaluate stage queued again

    def to_dict(self) -> dict:
        return asdict(self)


def _choose(failures: list[Failure], sample_ids: Iterable[int] | None, include_dropped: bool,
            report: RetryReport) -> list[Failure]:
    if sample_ids is None:
        return [f for f in failures if include_dropped or f.kind != FailureKind.DROPPED]
    wanted = set(sample_ids)
    report.unknown = sorted(wanted - {f.sample_id for f in failures})
    return [f for f in failures if f.sample_id in wanted]


def _check_not_busy(conn: redis.Redis, state: RunState, finished: bool) -> None:
    if reconciling(conn, state.run):
        raise RunBusy(f"run {state.run!r} is being reconciled right now; retry when the resume is done")
    meta = state.meta()
    if "train_enqueued_at" in meta and not finished and not RunPhase.of(meta.get("state")).terminal:
        raise RunBusy(f"run {state.run!r} is training or evaluating; retry its failures once it has finished")


def retry_failures(data: Path, conn: redis.Redis, run: str, *, stage: str | None = None,
                   sample_ids: Iterable[int] | None = None, include_dropped: bool = False) -> RetryReport:
    """Clear the chosen failure records so the feeder enqueues their samples again."""
    data = Path(data)
    spec = RunSpec.load(data, run)
    paths, state = RunPaths(data, run), RunState(conn, data, run)
    if "expected" not in state.meta():
        reconcile_run(data, conn, run)  # Redis lost the run: the volume says how it ended
    finished = read_finished(paths) is not None
    _check_not_busy(conn, state, finished)
    report = RetryReport(run=run)
    chosen = _choose(list_failures(data, run, stage=stage), sample_ids, include_dropped, report)
    prompts = run_ids(paths, spec).prompts
    retryable = []
    for failure in chosen:
        if failure.sample_id < len(prompts) and prompts[failure.sample_id]:
            retryable.append(failure)
        else:
            report.not_retryable.append({"sample_id": failure.sample_id, "stage": failure.stage, "reason":
                                         "the row was malformed at submission; fix the dataset and submit a new run"})
    if not retryable:
        if sample_ids is None and stage is None:
            report.resumed = resume_failed_stage(state)
        return report
    if finished or state.phase().terminal:
        report.superseded = reopen(state)
    for failure in retryable:
        _clear(state, failure)
        report.cleared.append({"sample_id": failure.sample_id, "stage": failure.stage})
    state.set_phase(RunPhase.GENERATING, feed_offset=0, extract_cursor=0)
    conn.hdel(state.keys.meta, "feed_pass_at", "extract_pass_at")
    log.info("run %s: %d failures cleared for another attempt", run, len(report.cleared))
    return report


def resume_failed_stage(state: RunState) -> dict | None:
    """Queue a failed run's failed train (or evaluate) job again; None when neither stage failed.

    The run leaves its terminal phase at once (so the supervisor does not record it finished again while the
    job waits); the job's own start moves its stage to running, and training resumes from the latest
    checkpoint there is."""
    meta = state.meta()
    if RunPhase.of(meta.get("state")) is not RunPhase.FAILED:
        return None
    failed = next((s for s in WHOLE_RUN_STAGES if StageState.of(meta.get(f"{s}_state")) is StageState.FAILED), None)
    if failed is None:
        return None
    finished_path(state.paths).unlink(missing_ok=True)
    phase = phase_for_stage(failed, StageState.RUNNING, unverified=0)  # training, or evaluating
    now = time.time()
    # A run rebuilt after a Redis loss has no train_enqueued_at: without it the supervisor would feed it again.
    state.set_phase(phase, retried_at=now, train_enqueued_at=meta.get("train_enqueued_at", now))
    # The stage reads pending until its job starts (a failed stage moves only to running).
    state.conn.hdel(state.keys.meta, "finished_at", "error", f"{failed}_error", f"{failed}_state")
    enqueue = enqueue_train if failed is Stage.TRAIN else enqueue_evaluate
    enqueue(state.conn, state.run, replace_failed=True)
    steps = state.paths.checkpoint_steps()
    step = steps[-1] if failed is Stage.TRAIN and steps else None
    log.info("run %s: its failed %s job is queued again%s", state.run, failed,
             f"; training resumes from its checkpoint at step {step}" if step is not None else "")
    return {"stage": str(failed), "checkpoint_step": step}


def _clear(state: RunState, failure: Failure) -> None:
    state.clear_failure(failure.stage, failure.sample_id)
    if failure.stage == Stage.EXTRACT and reply_problem(state.paths.generated(failure.sample_id), failure.sample_id):
        state.clear_done(Stage.GENERATE, failure.sample_id)  # the reply is gone too: generate it again first


def reopen(state: RunState) -> str | None:
    """Take a finished run back to its sample stages; returns where its old results went, if anywhere."""
    paths = state.paths
    target = paths.root / "superseded" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    moved = False
    for path in (paths.drafter_dir, paths.eval_report):
        if path.exists():
            target.mkdir(parents=True, exist_ok=True)
            path.rename(target / path.name)
            moved = True
    if moved:
        fsync_dir(target)
        fsync_dir(paths.root)
    finished_path(paths).unlink(missing_ok=True)
    stale = [k for k in state.meta() if k not in KEPT_META and (k.startswith(("train_", "evaluate_")) or k in
             ("export_path", "acceptance_length", "finished_at", "error"))]
    if stale:
        state.conn.hdel(state.keys.meta, *stale)
    log.info("run %s: reopened%s", state.run, f"; previous drafter moved to {target}" if moved else "")
    return str(target) if moved else None


# ---- jobs RQ failed -----------------------------------------------------------------------------


# A job that died of these failed for the infrastructure's sake, not its samples'.
INFRASTRUCTURE_ERRORS = ("redis.exceptions.ConnectionError", "redis.exceptions.TimeoutError", "ConnectionError: Error",
                         "TimeoutError: Timeout")


def name_failed_jobs(data: Path, conn: redis.Redis) -> int:
    """Name the unsettled samples of every failed generate and extract job, then forget the job."""
    named = 0
    for queue_name, stage in ((GENERATE_QUEUE, Stage.GENERATE), (EXTRACT_QUEUE, Stage.EXTRACT)):
        registry = queue(queue_name, conn).failed_job_registry
        for job_id in registry.get_job_ids():
            named += _name_job(Path(data), conn, registry, job_id, stage)
    return named


def _name_job(data: Path, conn: redis.Redis, registry: FailedJobRegistry, job_id: str, stage: str) -> int:
    try:
        job = Job.fetch(job_id, connection=conn, serializer=SERIALIZER)
    except NoSuchJobError:
        registry.remove(job_id)
        return 0
    payload = job.args[0] if job.args and isinstance(job.args[0], dict) else {}
    run = payload.get("run")
    ids = payload_sample_ids(payload)
    named = 0
    if run and RunPaths(data, run).spec.is_file():
        state = RunState(conn, data, run)
        result = job.latest_result()
        reason = ((result.exc_string if result else None) or "no reason recorded").strip().splitlines()[-1]
        if reason.startswith(INFRASTRUCTURE_ERRORS):
            # Redis went away under the job: nothing is wrong with its samples, so it runs again.
            registry.requeue(job)
            log.warning("run %s: job %s failed on %s; requeued", run, job_id, reason)
            return 0
        for sample_id in ids:
            if not any(bits[0] for bits in state.outcomes(stage, sample_id, sample_id + 1).values()):
                state.mark_failed(Failure(run=run, stage=stage, sample_id=sample_id, error_class="JobFailed",
                                          message=f"RQ job {job_id} failed: {reason}"))
                named += 1
        log.warning("run %s: job %s failed in RQ; %d of its samples named as %s failures", run, job_id, named, stage)
    # RQ's execution records can outlive the executions after its own cleanup failed the job; drop them
    # first, or removing the job raises and stalls every later supervisor pass.
    conn.delete(ExecutionRegistry(job_id=job.id, connection=conn).key)
    registry.remove(job, delete_job=True)
    return named
