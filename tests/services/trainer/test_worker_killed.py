"""A trainer worker killed mid-run (SIGKILL to its whole process group: the worker and its work horse)
and a fresh worker given the same job id: training resumes from the last checkpoint and ends exactly
where an uninterrupted run of the same seed and data ends."""

from __future__ import annotations

import json
import signal
import time

from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry

from services.trainer.checkpoint import list_checkpoints, read_checkpoint_state
from services.trainer.train import TIMING_FIELDS
from shared.atomic import temp_files
from shared.jobs import TRAIN_QUEUE, train_job_id
from shared.layout import RunPaths
from runtime.queues import SERIALIZER, queue
from runtime.runstate import RunState
from tests.services.trainer.test_jobs import enqueue_train, wait_for, worker

# 16 samples in batches of 4 over 12 epochs: 48 optimizer steps, a checkpoint every 2. The steps after the
# kill point leave the test ample time to kill before the run ends, even on a loaded machine.
TRAIN = {"epochs": 12, "batch_size": 4, "ttt_steps": 2, "save_every": 2, "lr": 1e-2}
NO_EVAL = {"holdout": 0, "sets": ["holdout"]}  # no set to evaluate: the job skips
TOTAL_STEPS = 48
KILL_AFTER_CHECKPOINT = 4  # the second checkpoint: resuming from it proves more than "the first one works"
# Exact equality, on purpose: on CPU every kernel is deterministic for a fixed thread count, the
# checkpoint restores fp32 weights, AdamW moments, scheduler and RNG bit for bit, and the data order is a
# pure function of (seed, epoch). Any difference at all means state was lost or a batch was replayed.
LOSS_TOLERANCE = 0.0
DONE = {JobStatus.FINISHED, JobStatus.FAILED}


def records(paths: RunPaths) -> list[dict]:
    return [json.loads(line) for line in paths.train_log.read_text().splitlines()]


def without_time(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]


def kill_when_checkpointed(service, paths: RunPaths, step: int, timeout: float = 300.0) -> int:
    """SIGKILL the worker's process group as soon as a checkpoint at ``step`` or later exists; the
    latest checkpoint at that moment."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert service.alive(), f"trainer exited before the kill:\n{service.log()}"
        found = [s for s, _ in list_checkpoints(paths.checkpoints_dir)]
        if found and found[-1] >= step:
            service.stop(signal.SIGKILL)
            return [s for s, _ in list_checkpoints(paths.checkpoints_dir)][-1]
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint at step {step} after {timeout}s:\n{service.log()}")


def requeue_abandoned(conn, job_id: str) -> None:
    """What a reaper does once it knows the worker is dead: RQ's own cleanup moves the job from the
    started registry to the failed one (AbandonedJobError), then the job goes back on its queue under
    the same id."""
    started = StartedJobRegistry(queue=queue(TRAIN_QUEUE, conn), serializer=SERIALIZER)
    assert job_id in started.get_job_ids(cleanup=False)
    started.cleanup(timestamp=time.time() + 365 * 24 * 3600)  # the dead worker never renews its lease
    job = Job.fetch(job_id, connection=conn, serializer=SERIALIZER)
    assert job.get_status() == JobStatus.FAILED
    job.requeue()


def test_a_killed_worker_resumes_from_its_last_checkpoint_on_a_new_worker(make_run, redis_url, redis_conn, data_dir,
                                                                           tiny_model_dir, tmp_path):
    straight = make_run("straight", train=TRAIN, evaluate=NO_EVAL)
    killed = make_run("killed", train=TRAIN, evaluate=NO_EVAL)
    logs = tmp_path / "logs"
    with worker(redis_url, data_dir, tiny_model_dir, logs) as first:
        enqueue_train(redis_conn, "straight")
        job = wait_for(redis_conn, train_job_id("straight"), first, DONE)
        assert job.get_status() == JobStatus.FINISHED, first.log()
        enqueue_train(redis_conn, "killed")
        resume_step = kill_when_checkpointed(first, killed, KILL_AFTER_CHECKPOINT)
    assert KILL_AFTER_CHECKPOINT <= resume_step < TOTAL_STEPS, "the run finished before the kill"
    before = killed.train_log.read_text().splitlines()
    assert Job.fetch(train_job_id("killed"), connection=redis_conn, serializer=SERIALIZER).get_status() == JobStatus.STARTED

    requeue_abandoned(redis_conn, train_job_id("killed"))
    with worker(redis_url, data_dir, tiny_model_dir, logs) as second:
        job = wait_for(redis_conn, train_job_id("killed"), second, DONE)
        assert job.get_status() == JobStatus.FINISHED, second.log()
        log = second.full_log()  # the resume lines lie before the evaluation's, which can fill a tail

    # It resumed from the checkpoint the kill left, not from step 0.
    assert f"resumed from {killed.checkpoint(resume_step)}" in log
    assert f"starting at step {resume_step}" in log
    after = killed.train_log.read_text().splitlines()
    assert after[:resume_step] == before[:resume_step]  # kept verbatim (their elapsed_s too): never retrained
    rows = records(killed)
    assert [r["step"] for r in rows] == list(range(1, TOTAL_STEPS + 1))  # every step once, none twice
    elapsed = [r["elapsed_s"] for r in rows]
    assert elapsed == sorted(elapsed)  # training time keeps counting across the resume

    # The curve after the resume is the uninterrupted run's, within LOSS_TOLERANCE.
    reference = records(straight)
    for mine, theirs in zip(rows, reference, strict=True):
        assert abs(mine["loss"] - theirs["loss"]) <= LOSS_TOLERANCE, (mine, theirs)
    assert without_time(rows) == without_time(reference)
    assert (killed.export_dir / "model.safetensors").read_bytes() == (straight.export_dir / "model.safetensors").read_bytes()
    assert read_checkpoint_state(killed.checkpoint(TOTAL_STEPS))["position"]["step"] == TOTAL_STEPS

    meta = RunState(redis_conn, data_dir, "killed").meta()
    assert meta["train_state"] == "done" and meta["train_done"] == meta["train_total"] == str(TOTAL_STEPS)
    assert temp_files(killed.root) == []  # a save cut short by the kill left nothing behind
