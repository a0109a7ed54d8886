"""A Prometheus collector that reads everything at scrape time: run counters and queues from Redis, the
data volume's usage, GPU readings. Every read is a few Redis commands or a syscall; nothing walks files,
so a scrape costs the same for a run of ten samples and one of a million.

Redis being down is a reading, not a failed scrape: ``draftline_redis_up`` drops to 0 and the volume and
GPU series are still served.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import worker_registration
from rq.queue import Queue
from rq.registry import StartedJobRegistry
from rq.worker import WorkerStatus

from shared import metrics
from runtime.gpu import GpuReader, GpuReading
from runtime.disk import disk_status
from runtime.spool import ONLINE_BLOCKED_S, ONLINE_EVICTED, ONLINE_EXTRACT_S, ONLINE_RELEASED, ONLINE_TRAIN_S, ONLINE_WAIT_S, online_status
from shared.jobs import (
    QUEUES,
    evaluate_job_id,
    extract_job_id,
    generate_job_id,
    train_job_id,
)
from shared.lifecycle import SAMPLE_STAGES, WHOLE_RUN_STAGES, Stage
from runtime.queues import SERIALIZER, queue
from runtime.runstate import RunState, known_runs, retried_field
from shared.errors import RunNotFound
from shared.runspec import cached_spec

log = logging.getLogger(__name__)

RUN_STAGE = ("run", "stage")
# A scrape must answer within Prometheus' scrape timeout (10 s by default) even when Redis is gone, so
# the exporter's connection gives up sooner than the workers' (runtime.queues.connect) and retries once,
# enough to replace a pooled connection that a Redis restart closed.
SCRAPE_CONNECT_TIMEOUT_S = 2.0
SCRAPE_SOCKET_TIMEOUT_S = 5.0
WORKER_STATES = (WorkerStatus.BUSY.value, WorkerStatus.IDLE.value)
# The field of an RQ worker's hash holding its state (rq.worker.BaseWorker.refresh reads it).
WORKER_STATE_FIELD = "state"
ACCURACY_FIELD = re.compile(rf"{metrics.META_TRAIN_ACCURACY_PREFIX}(\d+)")
VALIDATION_FIELD = re.compile(rf"{metrics.META_TRAIN_VALIDATION_PREFIX}(\d+)")
CURVE_FIELD = re.compile(rf"{re.escape(metrics.META_ACCEPTANCE_CURVE_PREFIX)}\.([^.]+)\.([^.]+)\.(\d+)")


def scrape_connection(url: str) -> redis.Redis:
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=SCRAPE_CONNECT_TIMEOUT_S,
        socket_timeout=SCRAPE_SOCKET_TIMEOUT_S,
        retry=Retry(NoBackoff(), 1),
    )


class Families:
    """The metric families of one scrape, created on first use and yielded in creation order."""

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}

    def gauge(self, name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
        return self._get(name, lambda: GaugeMetricFamily(name, doc, labels=list(labels)))

    def counter(self, name: str, doc: str, labels: Iterable[str] = ()) -> CounterMetricFamily:
        return self._get(name, lambda: CounterMetricFamily(name, doc, labels=list(labels)))

    def _get(self, name: str, make: Callable[[], Metric]) -> Metric:
        if name not in self._families:
            self._families[name] = make()
        return self._families[name]

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


class DraftlineCollector(Collector):
    """Registered once; ``collect`` runs on every scrape."""

    def __init__(
        self,
        conn: redis.Redis,
        data: Path,
        *,
        gpus: GpuReader | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.conn = conn
        self.data = Path(data)
        self.gpus = gpus
        self.clock = clock
        self._redis_up = True  # log changes of Redis' reachability, not every scrape during an outage

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(metrics.REDIS_UP, "1 when Redis answered this scrape, 0 when it did not.")
        from_redis = Families()
        try:
            self._collect_redis(from_redis)
        except redis.RedisError as exc:
            if self._redis_up:
                log.warning("redis unreachable; reporting %s 0 until it answers: %s", metrics.REDIS_UP, exc)
            self._redis_up = False
            from_redis = Families()  # drop what a scrape that lost Redis midway had half filled
        else:
            if not self._redis_up:
                log.info("redis reachable again")
            self._redis_up = True
        up.add_metric([], 1 if self._redis_up else 0)
        local = Families()
        _collect_volume(local, self.data)
        collect_gpus(local, self.gpus.read() if self.gpus else [])
        yield up
        yield from from_redis
        yield from local

    def _collect_redis(self, families: Families) -> None:
        runs = known_runs(self.conn)
        in_flight = _jobs_in_flight(self.conn, runs)
        now = self.clock()
        for run in runs:
            state = RunState(self.conn, self.data, run)
            meta = state.meta()
            for stage in SAMPLE_STAGES:
                _sample_stage(families, state, meta, stage, in_flight[(run, stage)], now)
            for stage in WHOLE_RUN_STAGES:
                _whole_run_stage(families, run, meta, stage, in_flight[(run, stage)])
            _run_meta(families, run, meta)
            _run_disk(families, run, disk_status(self.conn, run))
            _run_online(families, state, meta)
        _collect_queues(families, self.conn)


# ---- runs -----------------------------------------------------------------------------------------
def _sample_stage(
    families: Families, state: RunState, meta: dict[str, str], stage: str, in_flight: int, now: float
) -> None:
    labels = [state.run, stage]
    expected = int(_number(meta, "expected") or 0)
    counts = state.counts(stage)
    remaining = max(expected - counts.settled, 0)
    # An online run deletes its files (after their checkpoints, or unread to make room) and clears their done bits:
    # its extractions count with the deleted ones added back, so the counter still only grows (every epoch's).
    released = (int(_number(meta, ONLINE_RELEASED) or 0) + int(_number(meta, ONLINE_EVICTED) or 0)
                if stage == Stage.EXTRACT else 0)
    families.counter(metrics.STAGE_DONE, "Samples verified and finished by the stage.", RUN_STAGE).add_metric(
        labels, counts.done + released
    )
    # 0 until the first retry, so the series exists and rate() over it starts from the run's beginning.
    families.counter(
        metrics.STAGE_RETRIED, "Attempts repeated after a transient error or a lost job.", RUN_STAGE
    ).add_metric(labels, _number(meta, retried_field(stage)) or 0)
    families.gauge(metrics.STAGE_FAILED, "Samples whose latest attempt failed with a named error.", RUN_STAGE).add_metric(
        labels, counts.failed
    )
    families.gauge(metrics.STAGE_DROPPED, "Samples filtered out on purpose, each with a reason.", RUN_STAGE).add_metric(
        labels, counts.dropped
    )
    _progress(families, labels, expected, remaining, in_flight)
    # Absent, not a made-up number, while the recent rate cannot support an ETA (runtime.runstate.Throughput).
    eta = state.throughput(stage, now=now).eta_seconds(remaining)
    if eta is not None:
        families.gauge(metrics.STAGE_ETA, "Seconds until the stage finishes at its recent rate.", RUN_STAGE).add_metric(
            labels, eta
        )


def _whole_run_stage(families: Families, run: str, meta: dict[str, str], stage: str, in_flight: int) -> None:
    """Train and evaluate report progress as ``<stage>_done`` / ``<stage>_total`` meta fields once started."""
    total = _number(meta, f"{stage}_total")
    if total is None:
        return
    done = _number(meta, f"{stage}_done") or 0.0
    _progress(families, [run, stage], int(total), max(int(total - done), 0), in_flight)


def _progress(families: Families, labels: list[str], expected: int, remaining: int, in_flight: int) -> None:
    families.gauge(
        metrics.STAGE_EXPECTED, "Work items of the stage: samples, or steps for train and evaluate.", RUN_STAGE
    ).add_metric(labels, expected)
    families.gauge(metrics.STAGE_REMAINING, "Work items not yet settled (done, failed or dropped).", RUN_STAGE).add_metric(
        labels, remaining
    )
    families.gauge(metrics.STAGE_PROGRESS, "Share of the stage's work items settled, 0 to 1.", RUN_STAGE).add_metric(
        labels, (expected - remaining) / expected if expected else 0.0
    )
    families.gauge(metrics.STAGE_IN_FLIGHT, "RQ jobs of the run being worked on now.", RUN_STAGE).add_metric(
        labels, in_flight
    )


def _run_meta(families: Families, run: str, meta: dict[str, str]) -> None:
    series = (
        (metrics.RUN_HIDDEN_BYTES, metrics.META_HIDDEN_BYTES, "Bytes of hidden-state files written for the run."),
        (metrics.TRAIN_STEP, metrics.META_TRAIN_STEP, "Optimizer steps the trainer has finished."),
        (metrics.TRAIN_EPOCH, metrics.META_TRAIN_EPOCH, "Epoch (from 0) of the trainer's latest logged step."),
        (metrics.TRAIN_LOSS, metrics.META_TRAIN_LOSS, "The trainer's latest logged loss."),
        (metrics.TRAIN_LEARNING_RATE, metrics.META_TRAIN_LR, "The trainer's learning rate at its latest logged step."),
        (metrics.TRAIN_TOKENS_PER_SECOND, metrics.META_TRAIN_TOKENS_PER_SECOND,
         "Loss-mask tokens the trainer trains on per second."),
        (metrics.ACCEPTANCE_LENGTH, metrics.META_ACCEPTANCE_LENGTH, "Mean tokens accepted per verification step."),
    )
    for metric, field, doc in series:
        value = _number(meta, field)
        if value is not None:
            families.gauge(metric, doc, ["run"]).add_metric([run], value)
    _train_accuracy(families, run, meta)
    _acceptance_curve(families, run, meta)
    _over_lookup(families, run, meta)


def _acceptance_curve(families: Families, run: str, meta: dict[str, str]) -> None:
    """One series per evaluation set, method and chain length k (meta ``evaluate_accept.<set>.<method>.<k>``)."""
    points = sorted(((m.groups(), field) for field in meta if (m := CURVE_FIELD.fullmatch(field))),
                    key=lambda point: (point[0][0], point[0][1], int(point[0][2])))
    for (set_name, method, k), field in points:
        value = _number(meta, field)
        if value is not None:
            families.gauge(
                metrics.ACCEPTANCE_CURVE, "Tokens per target verification pass with k draft tokens, by set and method.",
                ["run", "set", "method", "k"],
            ).add_metric([run, set_name, method, k], value)


def _over_lookup(families: Families, run: str, meta: dict[str, str]) -> None:
    """The headline's margin over prompt lookup and its interval over the prompts, one series per bound."""
    prefix = metrics.META_OVER_LOOKUP
    for bound, field in (("difference", prefix), ("low", f"{prefix}_low"), ("high", f"{prefix}_high")):
        value = _number(meta, field)
        if value is not None:
            families.gauge(metrics.ACCEPTANCE_OVER_LOOKUP, "The drafter's acceptance length minus prompt lookup's at "
                           "the headline k, same prompts; low and high bound its interval over them.",
                           ["run", "bound"]).add_metric([run, bound], value)


def _train_accuracy(families: Families, run: str, meta: dict[str, str]) -> None:
    """One series per draft position k of the training-time-test unroll (meta ``train_acc<k>``), and one per k of
    the held-out one-pass acceptance where the run holds files out (meta ``train_val_accept<k>``)."""
    for pattern, metric, doc in (
        (ACCURACY_FIELD, metrics.TRAIN_ACCURACY, "Share of draft position k's tokens that match the target, 0 to 1."),
        (VALIDATION_FIELD, metrics.TRAIN_VALIDATION_ACCEPTANCE,
         "Acceptance length with k drafts a pass over the held-out files' turns (one pass), latest checkpoint."),
    ):
        for k, field in sorted((int(match.group(1)), field) for field in meta if (match := pattern.fullmatch(field))):
            value = _number(meta, field)
            if value is not None:
                families.gauge(metric, doc, ["run", "k"]).add_metric([run, str(k)], value)


def _run_disk(families: Families, run: str, disk: dict) -> None:
    """The supervisor's last disk verdict for the run: paused or not, and the projected bytes still needed."""
    families.gauge(metrics.RUN_DISK_PAUSED, "1 while the run's extraction waits for disk space.", ["run"]).add_metric(
        [run], 1 if disk["paused"] else 0
    )
    held = families.gauge(metrics.RUN_STAGE_HELD, "1 while the stage waits for disk space: held by the run's pause "
                          "(generate, extract) or its writer waiting for space (train, evaluate).", ["run", "stage"])
    for stage in Stage:
        held.add_metric([run, str(stage)], 1 if stage in disk["holds"] else 0)
    if disk["projected_bytes"] is not None:
        families.gauge(metrics.RUN_PROJECTED_BYTES, "Bytes the rest of the run still needs on the volume.",
                       ["run"]).add_metric([run], disk["projected_bytes"])


def _run_online(families: Families, state: RunState, meta: dict[str, str]) -> None:
    """An online run's spool against its budget, and its trainer's running and waiting seconds (counters, so
    rate() over a window gives the share of that window the trainer waited)."""
    try:
        spec = cached_spec(state.paths.data, state.run)
    except (RunNotFound, OSError, ValueError):
        return
    if not spec.online.enabled or spec.online.budget_bytes is None:
        return
    online = online_status(state, meta, spec.online.budget_bytes)
    run = [state.run]
    families.gauge(metrics.ONLINE_SPOOL_BYTES, "Bytes of the online run's hidden-state files on the volume.",
                   ["run"]).add_metric(run, online.spool_bytes)
    families.gauge(metrics.ONLINE_SPOOL_FILES, "The online run's hidden-state files on the volume.",
                   ["run"]).add_metric(run, online.spool_files)
    families.gauge(metrics.ONLINE_BUDGET_BYTES, "The online run's byte budget for its hidden-state files.",
                   ["run"]).add_metric(run, online.budget_bytes)
    families.gauge(metrics.ONLINE_EPOCH_TRAINED, "Samples the online trainer has trained in its current epoch.",
                   ["run"]).add_metric(run, online.epoch_trained)
    for metric, value, doc in (
        (metrics.ONLINE_WINDOW_FILES, online.window_files, "Samples the online trainer has asked for ahead."),
        (metrics.ONLINE_WINDOW_STEPS, online.window_steps, "Global batches the online trainer's window reaches into."),
        (metrics.ONLINE_WINDOW_BYTES, online.window_bytes, "Estimated bytes of the files the online trainer asked for "
                                                           "ahead."),
    ):
        families.gauge(metric, doc, ["run"]).add_metric(run, value)
    for metric, field, doc in (
        (metrics.ONLINE_TRAIN_SECONDS, ONLINE_TRAIN_S, "Seconds the online trainer has run, its waits included."),
        (metrics.ONLINE_TRAIN_WAIT_SECONDS, ONLINE_WAIT_S, "Seconds the online trainer has waited for files."),
        (metrics.ONLINE_EXTRACT_BLOCKED_SECONDS, ONLINE_BLOCKED_S,
         "Seconds extractions have waited for the online run's budget, summed over extractors."),
        (metrics.ONLINE_EXTRACT_SECONDS, ONLINE_EXTRACT_S,
         "Seconds the online run's extractions took once the budget granted them, summed over extractors."),
    ):
        families.counter(metric, doc, ["run"]).add_metric(run, _number(meta, field) or 0)


def _number(meta: dict[str, str], field: str) -> float | None:
    """A numeric meta field, or None when absent; a malformed value is logged and skipped, not fatal."""
    raw = meta.get(field)
    if raw is None or raw == "":
        return None
    try:
        return float(raw)
    except ValueError:
        log.warning("run meta field %s is not a number: %r", field, raw)
        return None


# ---- queues and workers ---------------------------------------------------------------------------
def _jobs_in_flight(conn: redis.Redis, runs: list[str]) -> Counter[tuple[str, str]]:
    """Started jobs per (run, stage), recognised by the job ids shared.jobs gives them."""
    owners = _job_id_owners(runs)
    found: Counter[tuple[str, str]] = Counter()
    for name in QUEUES:
        registry = StartedJobRegistry(queue=queue(name, conn), serializer=SERIALIZER)
        # No cleanup: a read-only exporter never moves abandoned jobs; the workers do that.
        for job_id in registry.get_job_ids(cleanup=False):
            owner = owners.get(job_id) or owners.get(job_id.rpartition("_")[0])
            if owner is not None:
                found[owner] += 1
    return found


def _job_id_owners(runs: list[str]) -> dict[str, tuple[str, str]]:
    """Job id (per-sample ids without their ``_<sample id>`` suffix) -> (run, stage)."""
    owners = {}
    for run in runs:
        owners[generate_job_id(run, 0).rpartition("_")[0]] = (run, Stage.GENERATE)
        owners[extract_job_id(run, 0).rpartition("_")[0]] = (run, Stage.EXTRACT)
        owners[train_job_id(run)] = (run, Stage.TRAIN)
        owners[evaluate_job_id(run)] = (run, Stage.EVALUATE)
    return owners


def _collect_queues(families: Families, conn: redis.Redis) -> None:
    jobs = families.gauge(metrics.QUEUE_JOBS, "Jobs waiting in the queue.", ["queue"])
    workers = families.gauge(metrics.QUEUE_WORKERS, "Workers listening on the queue, by state.", ["queue", "state"])
    for name in QUEUES:
        q = queue(name, conn)
        jobs.add_metric([name], q.count)
        states = _worker_states(conn, q)
        for state in sorted(set(WORKER_STATES) | set(states)):
            workers.add_metric([name, state], states[state])


def _worker_states(conn: redis.Redis, q: Queue) -> Counter[str]:
    """States of the workers registered on ``q``, read without writing: RQ's Worker.all() removes the
    registration of a worker whose hash expired (SREM), which the read-only exporter role may not do and
    which is the workers' own clean-up anyway. A registration without a hash is skipped, as Worker.all()
    skips it."""
    keys = sorted(worker_registration.get_keys(queue=q))
    pipe = conn.pipeline(transaction=False)
    for key in keys:
        pipe.hget(key, WORKER_STATE_FIELD)
    return Counter(state.decode() for state in pipe.execute() if state is not None)


# ---- volume and GPUs ------------------------------------------------------------------------------
def _collect_volume(families: Families, data: Path) -> None:
    try:
        usage = shutil.disk_usage(data)
    except OSError as exc:
        log.warning("cannot read usage of the data volume %s: %s", data, exc)
        return
    families.gauge(metrics.VOLUME_USED, "Bytes used on the filesystem holding the data volume.").add_metric([], usage.used)
    families.gauge(metrics.VOLUME_FREE, "Bytes free on the filesystem holding the data volume.").add_metric([], usage.free)


def collect_gpus(families: Families, readings: list[GpuReading]) -> None:
    families.gauge(metrics.GPUS, "GPUs visible through NVML; 0 without a driver or GPUs.").add_metric([], len(readings))
    series = (
        (metrics.GPU_UTILIZATION, "utilization_ratio", "Share of time a kernel ran, 0 to 1."),
        (metrics.GPU_MEMORY_USED, "memory_used_bytes", "GPU memory in use."),
        (metrics.GPU_MEMORY_TOTAL, "memory_total_bytes", "GPU memory installed."),
        (metrics.GPU_TEMPERATURE, "temperature_celsius", "GPU core temperature."),
        (metrics.GPU_POWER, "power_watts", "Power drawn by the board."),
    )
    for reading in readings:
        labels = [str(reading.index), reading.name]
        for metric, field, doc in series:
            value = getattr(reading, field)
            if value is not None:
                families.gauge(metric, doc, ["gpu", "name"]).add_metric(labels, value)
