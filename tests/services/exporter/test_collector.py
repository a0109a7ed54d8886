"""The collector against a real Redis: what a run's state, the queues and the workers look like as metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest

from shared import metrics
from services.exporter.collector import (
    DraftlineCollector,
    Families,
    collect_gpus,
    scrape_connection,
)
from runtime.gpu import GpuReader, GpuReading
from shared.jobs import (
    EXTRACT_FUNC,
    EXTRACT_QUEUE,
    GENERATE_QUEUE,
    TRAIN_FUNC,
    TRAIN_QUEUE,
    extract_job_id,
    train_job_id,
)
from runtime.queues import queue
from runtime.runstate import RunState
from shared.lifecycle import Failure, FailureKind
from tests.services.exporter.scrape import Samples, parse, value
from tests.services.controller.loop.test_reaper import take
from tests.support.processes import REPO, free_port


def scrape(url: str, data: Path, *, clock=time.time, gpus: GpuReader | None = None) -> Samples:
    registry = CollectorRegistry()
    registry.register(DraftlineCollector(scrape_connection(url), data, gpus=gpus, clock=clock))
    return parse(generate_latest(registry).decode())


def populate(conn: redis.Redis, data: Path, run: str = "r1") -> RunState:
    state = RunState(conn, data, run)
    state.register(10)
    for sample_id in range(4):
        state.mark_done("generate", sample_id)
    state.mark_done("extract", 0)
    state.mark_failed(Failure(run, "generate", 5, "InferenceRejected", "400 from the server"))
    state.mark_failed(Failure(run, "generate", 6, "ReplyTooShort", "3 tokens", kind=FailureKind.DROPPED))
    return state


def test_sample_stage_counts_progress_and_remaining(redis_url, redis_conn, data_dir) -> None:
    populate(redis_conn, data_dir)
    samples = scrape(redis_url, data_dir)
    gen = {"run": "r1", "stage": "generate"}
    assert value(samples, metrics.REDIS_UP) == 1
    assert value(samples, metrics.STAGE_EXPECTED, **gen) == 10
    assert value(samples, metrics.STAGE_DONE, **gen) == 4
    assert value(samples, metrics.STAGE_FAILED, **gen) == 1
    assert value(samples, metrics.STAGE_DROPPED, **gen) == 1
    assert value(samples, metrics.STAGE_REMAINING, **gen) == 4
    assert value(samples, metrics.STAGE_PROGRESS, **gen) == pytest.approx(0.6)
    assert value(samples, metrics.STAGE_DONE, run="r1", stage="extract") == 1
    assert value(samples, metrics.STAGE_REMAINING, run="r1", stage="extract") == 9


def test_a_retried_sample_leaves_the_failed_gauge(redis_url, redis_conn, data_dir) -> None:
    state = populate(redis_conn, data_dir)
    state.mark_done("generate", 5)
    samples = scrape(redis_url, data_dir)
    assert value(samples, metrics.STAGE_FAILED, run="r1", stage="generate") == 0
    assert value(samples, metrics.STAGE_DONE, run="r1", stage="generate") == 5


def test_eta_is_remaining_over_the_recent_rate(redis_url, redis_conn, data_dir) -> None:
    state = RunState(redis_conn, data_dir, "r1")
    state.register(100)
    start = 1_700_000_002.5
    for sample_id in range(40):  # one sample every 2 s, then read 80 s after the first
        state.mark_done("generate", sample_id, now=start + 2 * sample_id)
    state.mark_done("extract", 0, now=start)
    now = start + 80
    samples = scrape(redis_url, data_dir, clock=lambda: now)
    rate = state.throughput("generate", now=now).per_second
    assert rate == pytest.approx(40 / 80)
    assert value(samples, metrics.STAGE_ETA, run="r1", stage="generate") == pytest.approx(60 / rate)
    # One extraction is not enough for an ETA: absent rather than a made-up one.
    assert value(samples, metrics.STAGE_ETA, run="r1", stage="extract") is None


def test_a_burst_is_no_eta(redis_url, redis_conn, data_dir) -> None:
    state = RunState(redis_conn, data_dir, "r1")
    state.register(100)
    for sample_id in range(50):  # one batch landing at once, moments ago
        state.mark_done("generate", sample_id)
    samples = scrape(redis_url, data_dir)
    assert value(samples, metrics.STAGE_REMAINING, run="r1", stage="generate") == 50
    assert value(samples, metrics.STAGE_ETA, run="r1", stage="generate") is None


def test_eta_is_zero_once_nothing_remains(redis_url, redis_conn, data_dir) -> None:
    state = RunState(redis_conn, data_dir, "small")
    state.register(1)
    state.mark_done("generate", 0)
    samples = scrape(redis_url, data_dir)
    assert value(samples, metrics.STAGE_ETA, run="small", stage="generate") == 0
    assert value(samples, metrics.STAGE_PROGRESS, run="small", stage="generate") == 1


def test_whole_run_stages_and_meta_tallies(redis_url, redis_conn, data_dir) -> None:
    state = populate(redis_conn, data_dir)
    state.set_progress("train", 25, 200, loss=2.5)
    state.incr("hidden_bytes", 4096)
    state.incr("hidden_bytes", 1024)
    state.set_meta(acceptance_length=2.75)
    samples = scrape(redis_url, data_dir)
    train = {"run": "r1", "stage": "train"}
    assert value(samples, metrics.STAGE_EXPECTED, **train) == 200
    assert value(samples, metrics.STAGE_REMAINING, **train) == 175
    assert value(samples, metrics.STAGE_PROGRESS, **train) == pytest.approx(0.125)
    assert value(samples, metrics.TRAIN_STEP, run="r1") == 25
    assert value(samples, metrics.TRAIN_LOSS, run="r1") == 2.5
    assert value(samples, metrics.RUN_HIDDEN_BYTES, run="r1") == 5120
    assert value(samples, metrics.ACCEPTANCE_LENGTH, run="r1") == 2.75
    # Evaluation has not started: no series rather than a zero that reads as "nothing to do".
    assert value(samples, metrics.STAGE_EXPECTED, run="r1", stage="evaluate") is None


def test_the_acceptance_curve_is_one_series_per_set_method_and_k(redis_url, redis_conn, data_dir) -> None:
    state = populate(redis_conn, data_dir)
    # The fields the evaluate job writes (services/trainer/jobs.py curve_meta); a malformed one is skipped.
    state.set_meta(**{"evaluate_accept.holdout.drafter.1": 1.5, "evaluate_accept.holdout.drafter.7": 2.25,
                      "evaluate_accept.humaneval.lookup.3": 1.75, "evaluate_accept.holdout.no_drafter.0": 1.0,
                      "evaluate_accept.holdout.drafter.x": 9, "evaluate_accept.broken": 9})
    samples = scrape(redis_url, data_dir)
    found = {dict(labels)["set"] + "." + dict(labels)["method"] + "." + dict(labels)["k"]: v
             for (name, labels), v in samples.items() if name == metrics.ACCEPTANCE_CURVE}
    assert found == {"holdout.drafter.1": 1.5, "holdout.drafter.7": 2.25, "humaneval.lookup.3": 1.75,
                     "holdout.no_drafter.0": 1.0}


def test_the_margin_over_lookup_is_a_series_per_bound(redis_url, redis_conn, data_dir) -> None:
    state = populate(redis_conn, data_dir)
    assert not [name for name, _ in scrape(redis_url, data_dir) if name == metrics.ACCEPTANCE_OVER_LOOKUP]
    # The fields the evaluate job writes (services/trainer/jobs.py lookup_meta).
    state.set_meta(**{metrics.META_OVER_LOOKUP: 0.52, f"{metrics.META_OVER_LOOKUP}_low": 0.45,
                      f"{metrics.META_OVER_LOOKUP}_high": 0.59, f"{metrics.META_OVER_LOOKUP}_prompts": 252})
    samples = scrape(redis_url, data_dir)
    assert {bound: value(samples, metrics.ACCEPTANCE_OVER_LOOKUP, run="r1", bound=bound)
            for bound in ("difference", "low", "high")} == {"difference": 0.52, "low": 0.45, "high": 0.59}


def test_retries_count_per_stage_and_start_at_zero(redis_url, redis_conn, data_dir) -> None:
    state = populate(redis_conn, data_dir)
    samples = scrape(redis_url, data_dir)
    # No retry yet: the series exists at 0, so rate() and the dashboards see the run from its start.
    assert value(samples, metrics.STAGE_RETRIED, run="r1", stage="generate") == 0
    assert value(samples, metrics.STAGE_RETRIED, run="r1", stage="extract") == 0
    state.note_retry("extract")
    state.note_retry("extract")
    state.note_retry("generate")
    samples = scrape(redis_url, data_dir)
    assert value(samples, metrics.STAGE_RETRIED, run="r1", stage="extract") == 2
    assert value(samples, metrics.STAGE_RETRIED, run="r1", stage="generate") == 1
    # Retries are attempts, not outcomes: the done and failed counts do not move.
    assert value(samples, metrics.STAGE_DONE, run="r1", stage="extract") == 1
    assert value(samples, metrics.STAGE_FAILED, run="r1", stage="generate") == 1


def test_trainer_epoch_accuracy_per_position_lr_and_tokens_per_second(redis_url, redis_conn, data_dir) -> None:
    state = populate(redis_conn, data_dir)
    # The fields the trainer's progress report writes (services/trainer/jobs.py), through the same call.
    accs = {f"acc{k}": a for k, a in enumerate([0.61, 0.42, 0.3, 0.21, 0.15, 0.11, 0.08, 0.06, 0.05, 0.04, 0.03])}
    state.set_progress("train", 40, 120, loss=1.75, epoch=1, lr=0.0005, tokens_per_s=812.5, **accs)
    samples = scrape(redis_url, data_dir)
    assert value(samples, metrics.TRAIN_STEP, run="r1") == 40
    assert value(samples, metrics.TRAIN_EPOCH, run="r1") == 1
    assert value(samples, metrics.TRAIN_LOSS, run="r1") == 1.75
    assert value(samples, metrics.TRAIN_LEARNING_RATE, run="r1") == 0.0005
    assert value(samples, metrics.TRAIN_TOKENS_PER_SECOND, run="r1") == 812.5
    # Two-digit positions too: k is the number after the prefix, not a character of it.
    for k, acc in enumerate(accs.values()):
        assert value(samples, metrics.TRAIN_ACCURACY, run="r1", k=str(k)) == acc
    assert value(samples, metrics.TRAIN_ACCURACY, run="r1", k="11") is None
    assert not any(name == metrics.TRAIN_VALIDATION_ACCEPTANCE for name, _ in samples)  # no files held out
    state.set_progress("train", 48, 120, val_accept1=1.5, val_accept7=2.25, val_acceptx=9)
    samples = scrape(redis_url, data_dir)
    assert value(samples, metrics.TRAIN_VALIDATION_ACCEPTANCE, run="r1", k="1") == 1.5
    assert value(samples, metrics.TRAIN_VALIDATION_ACCEPTANCE, run="r1", k="7") == 2.25
    assert value(samples, metrics.TRAIN_ACCURACY, run="r1", k="1") == accs["acc1"]  # the other series stay


def test_trainer_series_are_absent_before_training_starts(redis_url, redis_conn, data_dir) -> None:
    populate(redis_conn, data_dir)
    samples = scrape(redis_url, data_dir)
    for metric in (metrics.TRAIN_EPOCH, metrics.TRAIN_ACCURACY, metrics.TRAIN_LEARNING_RATE, metrics.TRAIN_TOKENS_PER_SECOND):
        assert not any(name == metric for name, _ in samples), metric


def test_a_malformed_meta_field_is_skipped_not_fatal(redis_url, redis_conn, data_dir) -> None:
    state = populate(redis_conn, data_dir)
    state.set_meta(train_loss="not-a-number", acceptance_length=3.0, train_acc0="nan?", train_acc1=0.5)
    broken = populate(redis_conn, data_dir, "broken")
    broken.set_meta(expected="")
    samples = scrape(redis_url, data_dir)
    assert value(samples, metrics.TRAIN_LOSS, run="r1") is None
    assert value(samples, metrics.ACCEPTANCE_LENGTH, run="r1") == 3.0
    assert value(samples, metrics.TRAIN_ACCURACY, run="r1", k="0") is None
    assert value(samples, metrics.TRAIN_ACCURACY, run="r1", k="1") == 0.5
    assert value(samples, metrics.STAGE_EXPECTED, run="broken", stage="generate") == 0
    assert value(samples, metrics.STAGE_DONE, run="broken", stage="generate") == 4
    assert value(samples, metrics.REDIS_UP) == 1


def test_every_run_in_redis_is_reported(redis_url, redis_conn, data_dir) -> None:
    populate(redis_conn, data_dir, "alpha")
    populate(redis_conn, data_dir, "beta")
    samples = scrape(redis_url, data_dir)
    for run in ("alpha", "beta"):
        assert value(samples, metrics.STAGE_DONE, run=run, stage="generate") == 4


def test_queue_depth_counts_waiting_jobs(redis_url, redis_conn, data_dir) -> None:
    extract = queue(EXTRACT_QUEUE, redis_conn)
    for sample_id in range(3):
        extract.enqueue_call(EXTRACT_FUNC, args=({"run": "r1", "sample_id": sample_id},),
                             job_id=extract_job_id("r1", sample_id))
    samples = scrape(redis_url, data_dir)
    assert value(samples, metrics.QUEUE_JOBS, queue=EXTRACT_QUEUE) == 3
    assert value(samples, metrics.QUEUE_JOBS, queue=GENERATE_QUEUE) == 0
    assert value(samples, metrics.QUEUE_WORKERS, queue=EXTRACT_QUEUE, state="idle") == 0


def start_worker(redis_url: str, queue_name: str, log_path: Path) -> subprocess.Popen:
    """A real RQ worker started the way every draftline worker service starts (runtime.worker)."""
    code = (
        "from runtime.worker import run_worker; from shared.settings import CommonSettings; "
        f"run_worker([{queue_name!r}], CommonSettings(), role='probe')"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, env={**os.environ, "REDIS_URL": redis_url},
        stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )


def wait_for(check, what: str, log_paths: list[Path], timeout: float = 60.0) -> Samples:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result is not None:
            return result
        time.sleep(0.2)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in log_paths if p.exists())
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def test_busy_and_idle_workers_and_jobs_in_flight(redis_url, redis_conn, data_dir, tmp_path) -> None:
    populate(redis_conn, data_dir, "r1")
    populate(redis_conn, data_dir, "my_run.v2")  # a name RQ cannot take verbatim inside a job id
    RunState(redis_conn, data_dir, "r1").set_progress("train", 0, 100)
    logs = {GENERATE_QUEUE: tmp_path / "generate.log"}
    workers = [start_worker(redis_url, GENERATE_QUEUE, logs[GENERATE_QUEUE])]  # a real process, idle
    try:
        # Workers only run draftline's own job functions, and these jobs must stay running while the
        # test scrapes: they are taken the way RQ's own worker takes a job (dequeue, execution, busy),
        # with no work horse behind them, so they never end.
        queue(TRAIN_QUEUE, redis_conn).enqueue_call(TRAIN_FUNC, args=({"run": "r1"},), job_id=train_job_id("r1"))
        queue(EXTRACT_QUEUE, redis_conn).enqueue_call(EXTRACT_FUNC, args=({"run": "my_run.v2", "sample_id": 7},),
                                                     job_id=extract_job_id("my_run.v2", 7))
        take(redis_conn, "trainer-busy", TRAIN_QUEUE)
        take(redis_conn, "extractor-busy", EXTRACT_QUEUE)

        def settled() -> Samples | None:
            samples = scrape(redis_url, data_dir)
            ready = (
                value(samples, metrics.QUEUE_WORKERS, queue=TRAIN_QUEUE, state="busy") == 1
                and value(samples, metrics.QUEUE_WORKERS, queue=EXTRACT_QUEUE, state="busy") == 1
                and value(samples, metrics.QUEUE_WORKERS, queue=GENERATE_QUEUE, state="idle") == 1
            )
            return samples if ready else None

        wait_for(settled, "busy train and extract workers and an idle generate worker", list(logs.values()))
        # A scrape reads the started-job registries before the workers, so the scrape that first sees a
        # worker busy may have read its registry just before the job started. RQ records a started job in
        # the transaction that marks its worker busy, and these jobs never end: a scrape begun after both
        # workers were seen busy counts both jobs.
        samples = scrape(redis_url, data_dir)
        assert value(samples, metrics.QUEUE_WORKERS, queue=TRAIN_QUEUE, state="idle") == 0
        assert value(samples, metrics.QUEUE_WORKERS, queue=GENERATE_QUEUE, state="busy") == 0
        assert value(samples, metrics.QUEUE_JOBS, queue=TRAIN_QUEUE) == 0
        assert value(samples, metrics.STAGE_IN_FLIGHT, run="r1", stage="train") == 1
        assert value(samples, metrics.STAGE_IN_FLIGHT, run="my_run.v2", stage="extract") == 1
        assert value(samples, metrics.STAGE_IN_FLIGHT, run="r1", stage="extract") == 0
        assert value(samples, metrics.STAGE_IN_FLIGHT, run="my_run.v2", stage="generate") == 0
    finally:
        for proc in workers:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_redis_down_is_a_reading_not_a_failed_scrape(data_dir) -> None:
    samples = scrape(f"redis://127.0.0.1:{free_port()}/0", data_dir)
    assert value(samples, metrics.REDIS_UP) == 0
    assert not any(name.startswith(("draftline_stage_", "draftline_queue_")) for name, _ in samples)
    assert value(samples, metrics.VOLUME_FREE) > 0
    assert value(samples, metrics.GPUS) == 0


def test_volume_usage_is_that_of_the_filesystem_holding_the_data(redis_url, data_dir) -> None:
    samples = scrape(redis_url, data_dir)
    usage = os.statvfs(data_dir)
    assert value(samples, metrics.VOLUME_USED) > 0
    # Free space moves while the test runs; the scrape and statvfs agree to within a gigabyte.
    assert value(samples, metrics.VOLUME_FREE) == pytest.approx(usage.f_bavail * usage.f_frsize, abs=1 << 30)


def test_a_missing_data_directory_drops_only_the_volume_series(redis_url, tmp_path) -> None:
    samples = scrape(redis_url, tmp_path / "absent")
    assert value(samples, metrics.VOLUME_FREE) is None
    assert value(samples, metrics.REDIS_UP) == 1


def test_no_nvml_means_zero_gpus_without_an_error(redis_url, data_dir) -> None:
    gpus = GpuReader()
    if gpus.available and gpus.read():
        pytest.skip("this machine has GPUs")
    samples = scrape(redis_url, data_dir, gpus=gpus)
    assert value(samples, metrics.GPUS) == 0
    assert not any(name.startswith("draftline_gpu_") for name, _ in samples)


def test_gpu_readings_become_labelled_series_and_missing_fields_are_left_out() -> None:
    readings = [
        GpuReading(0, "NVIDIA H200", 0.5, 10 << 30, 141 << 30, 55.0, 300.0),
        GpuReading(1, "NVIDIA H200", 0.0, 0, 141 << 30, 40.0, None),  # a board that reports no power
    ]
    families = Families()
    collect_gpus(families, readings)
    samples = {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}
    assert value(samples, metrics.GPUS) == 2
    assert value(samples, metrics.GPU_UTILIZATION, gpu="0", name="NVIDIA H200") == 0.5
    assert value(samples, metrics.GPU_MEMORY_TOTAL, gpu="1", name="NVIDIA H200") == 141 << 30
    assert value(samples, metrics.GPU_POWER, gpu="0", name="NVIDIA H200") == 300.0
    assert value(samples, metrics.GPU_POWER, gpu="1", name="NVIDIA H200") is None


def test_a_run_paused_for_disk_and_its_projection_are_exported(redis_url, redis_conn, data_dir) -> None:
    from runtime.disk import StageHold, clear_paused, set_paused, supervise_disk
    from shared.lifecycle import Stage
    from shared.settings import ControllerSettings

    populate(redis_conn, data_dir)
    assert value(scrape(redis_url, data_dir), metrics.RUN_DISK_PAUSED, run="r1") == 0
    settings = ControllerSettings(data=data_dir, redis_url=redis_url)
    headroom = supervise_disk(settings, RunState(redis_conn, data_dir, "r1"))
    assert value(scrape(redis_url, data_dir), metrics.RUN_PROJECTED_BYTES, run="r1") == headroom.projected_bytes
    set_paused(redis_conn, "r1", "projected 2 TiB, 1 TiB free")
    assert value(scrape(redis_url, data_dir), metrics.RUN_DISK_PAUSED, run="r1") == 1
    held = scrape(redis_url, data_dir)
    assert [value(held, metrics.RUN_STAGE_HELD, run="r1", stage=s) for s in ("generate", "extract", "train", "evaluate")] \
        == [1, 1, 0, 0]
    clear_paused(redis_conn, "r1")
    assert value(scrape(redis_url, data_dir), metrics.RUN_DISK_PAUSED, run="r1") == 0
    StageHold(redis_conn, "r1", Stage.TRAIN).hold("writing checkpoint step 5 found /data full")
    held = scrape(redis_url, data_dir)
    assert [value(held, metrics.RUN_STAGE_HELD, run="r1", stage=s) for s in ("generate", "extract", "train", "evaluate")] \
        == [0, 0, 1, 0]
