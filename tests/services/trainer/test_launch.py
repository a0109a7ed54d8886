"""The train job with DRAFTLINE_TRAIN_PROCS=2: torchrun processes on the CPU (gloo), real Redis, the real volume."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
import time

import pytest
import torch
from rq.job import Job
from safetensors.torch import load_file

from modeling.export import verify_export
from services.trainer.launch import TrainingProcessFailed, torchrun_command, train_procs
from services.trainer.lock import TrainingInProgress, exclusive_training
from shared.errors import BaseCheckpointMismatch, SettingsError
from shared.jobs import evaluate_job_id, train_job_id
from runtime.queues import SERIALIZER
from runtime.requeue import REQUEUES_META
from runtime.runstate import RunState
from shared.settings import TrainerSettings, load_settings
from tests.services.trainer.test_jobs import enqueue_train
from tests.support.processes import ServiceProcess

TRAIN = {"epochs": 2, "ttt_steps": 2, "save_every": 4}  # 16 samples, global batches of 2 x 4: 4 steps


@pytest.fixture()
def ddp_jobs(job_settings, monkeypatch):
    """The job functions with two training processes; PATH holds no torchrun (nor anything else)."""
    monkeypatch.setenv("DRAFTLINE_TRAIN_PROCS", "2")
    monkeypatch.setenv("PATH", "/nonexistent")
    job_settings.get_settings.cache_clear()
    return job_settings


def log_records(paths) -> list[dict]:
    return [json.loads(line) for line in paths.train_log.read_text().splitlines()]


def test_the_train_job_in_two_processes_reports_progress_and_exports_the_last_checkpoint(ddp_jobs, make_run, redis_conn, data_dir):
    paths = make_run("ddp", train=TRAIN)
    assert ddp_jobs.train({"run": "ddp"}) == {"run": "ddp", "steps": 4, "export_path": str(paths.export_dir),
                                             "draft_vocab": "training data"}
    meta = RunState(redis_conn, data_dir, "ddp").meta()
    assert meta["train_state"] == "done" and meta["train_procs"] == "2"
    assert meta["train_done"] == meta["train_total"] == "4" and meta["train_epoch"] == "1"
    records = log_records(paths)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert float(meta["train_loss"]) == pytest.approx(records[-1]["loss"], abs=1e-5)  # rank 0 reported the global loss
    assert float(meta["train_acc0"]) == pytest.approx(records[-1]["acc"][0], abs=1e-4) and "train_acc1" in meta
    assert float(meta["train_tokens_per_s"]) > 0 and float(meta["train_lr"]) == pytest.approx(records[-1]["lr"])
    verify_export(paths.export_dir)
    exported, trained = load_file(paths.export_dir / "model.safetensors"), load_file(paths.checkpoint(4) / "model.safetensors")
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
    assert redis_conn.exists(Job.key_for(evaluate_job_id("ddp")))


def test_a_failing_rank_fails_the_job_with_a_named_error_and_its_cause(ddp_jobs, make_run, redis_conn, data_dir):
    paths = make_run("broken", train=TRAIN)
    victim = paths.hidden(7)
    victim.write_bytes(victim.read_bytes()[:-64])
    with pytest.raises(TrainingProcessFailed) as info:
        ddp_jobs.train({"run": "broken"})
    message = str(info.value)
    assert re.search(r"rank [01] of 2 failed first: HiddenStateFileError: ", message) and str(victim) in message
    assert "torchrun exited with 1" in message and "last output of rank" in message
    meta = RunState(redis_conn, data_dir, "broken").meta()
    assert meta["train_state"] == "failed" and meta["train_error"].startswith("TrainingProcessFailed: rank ")
    assert not paths.export_dir.exists()


def test_a_base_checkpoint_that_does_not_fit_fails_the_job_by_name_before_any_rank_starts(ddp_jobs, make_run, redis_conn,
                                                                                            data_dir, tiny_model_dir):
    from tests.support.published_drafter import Published, write_published_drafter

    write_published_drafter(data_dir / "published" / "drafter", tiny_model_dir, Published(hidden_size=32))
    paths = make_run("misfit", train={**TRAIN, "base_checkpoint": "published/drafter"})
    with pytest.raises(BaseCheckpointMismatch, match="hidden_size is 32, the target's hidden_size is 64"):
        ddp_jobs.train({"run": "misfit"})
    meta = RunState(redis_conn, data_dir, "misfit").meta()
    assert meta["train_state"] == "failed" and meta["train_error"].startswith("BaseCheckpointMismatch: ")
    assert "train_procs" not in meta and not paths.checkpoints_dir.exists()  # no rank was started


def test_a_killed_rank_fails_the_job_instead_of_hanging_and_the_next_job_resumes(ddp_jobs, make_run, redis_conn, data_dir, caplog):
    paths = make_run("killed", train={**TRAIN, "epochs": 20, "save_every": 2})  # 40 steps
    caplog.set_level(logging.INFO)
    outcome: dict = {}

    def job() -> None:
        try:
            ddp_jobs.train({"run": "killed"})
        except Exception as exc:  # noqa: BLE001 - the job's failure, whatever its class, is examined below
            outcome["error"] = exc

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    state = RunState(redis_conn, data_dir, "killed")
    deadline = time.monotonic() + 300
    while state.progress("train")[0] < 3:  # past step 2, whose checkpoint rank 0 writes before step 3
        assert time.monotonic() < deadline and thread.is_alive(), f"training did not reach step 3: {outcome}"
        time.sleep(0.02)
    pid = int(re.search(r"rank 1 of 2 \(pid (\d+)\)", caplog.text).group(1))
    os.kill(pid, signal.SIGKILL)  # what the out-of-memory killer does
    thread.join(timeout=120)
    assert not thread.is_alive(), "the job hangs after a rank died"
    assert isinstance(outcome.get("error"), TrainingProcessFailed)
    message = str(outcome["error"])
    assert re.match(r"ranks \[(0, )?1\] of 2 ended without an error of their own", message)  # rank 0 may be stopped first
    assert "torchrun exited with 1" in message and "SIGKILL" in message  # torchrun's summary names the signal
    assert state.meta()["train_state"] == "failed"

    caplog.clear()
    assert ddp_jobs.train({"run": "killed"})["steps"] == 40
    assert re.search(r"rank 0 services.trainer.checkpoint: resumed from .*step_0000000[2-9]", caplog.text)
    assert [r["step"] for r in log_records(paths)] == list(range(1, 41))
    verify_export(paths.export_dir)


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: state, parent pid, ...; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None


def gone(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is None or fields[0] == "Z"  # a zombie no longer runs; its new parent may never reap it


def test_a_work_horse_killed_as_rq_kills_it_leaves_no_rank_training(make_run, redis_url, redis_conn, data_dir, tiny_model_dir, tmp_path):
    paths = make_run("horse", train={**TRAIN, "epochs": 30, "save_every": 2})  # 60 steps
    env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_MODEL_DIR": str(tiny_model_dir),
           "DRAFTLINE_DEVICE": "cpu", "DRAFTLINE_LOG_LEVEL": "INFO", "DRAFTLINE_TRAIN_PROCS": "2"}
    with ServiceProcess("trainer", env=env, log_dir=tmp_path / "logs") as service:
        enqueue_train(redis_conn, "horse")
        state, deadline = RunState(redis_conn, data_dir, "horse"), time.monotonic() + 300
        while state.progress("train")[0] < 2:
            assert time.monotonic() < deadline and service.alive(), service.log()
            time.sleep(0.05)
        ranks = [int(pid) for pid in re.findall(r"rank \d of 2 \(pid (\d+)\)", service.log())]
        torchrun = int(stat_fields(ranks[0])[1])
        horse = int(stat_fields(torchrun)[1])
        # RQ's kill_horse (a job past its timeout, a second stop signal): SIGKILL to the horse's process
        # group, which holds torchrun but not the ranks (torchrun starts each in a session of its own).
        os.killpg(os.getpgid(horse), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not all(gone(pid) for pid in [*ranks, torchrun]):
            assert time.monotonic() < deadline, f"ranks still running after their job was killed: {ranks}"
            time.sleep(0.1)
        assert len(ranks) == 2 and state.progress("train")[0] < 60  # killed mid-run, not after it
        # A horse killed from outside (the OOM killer) is a lost execution: its worker, alive, runs the
        # job again from its last checkpoint, with ranks of its own (started as slowly as the first ones).
        deadline = time.monotonic() + 300
        while len(re.findall(r"rank \d of 2 \(pid (\d+)\)", service.log())) < 4:
            assert time.monotonic() < deadline and service.alive(), service.log()
            time.sleep(0.1)
        assert Job.fetch(train_job_id("horse"), connection=redis_conn,
                         serializer=SERIALIZER).meta[REQUEUES_META] == 1
        service.stop(signal.SIGKILL)  # the worker, then its horse, torchrun and ranks, each with its parent
    deadline = time.monotonic() + 60
    while True:
        try:
            with exclusive_training(paths):
                break  # the run's lock is free for the next trainer: no rank outlived the worker
        except TrainingInProgress:
            assert time.monotonic() < deadline, "a rank still holds the run's lock after its worker died"
            time.sleep(0.2)


def test_torchrun_starts_from_this_python_not_from_path(tmp_path):
    command = torchrun_command("run", 2, tmp_path)
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--nproc-per-node=2" in command


@pytest.mark.skipif(torch.cuda.is_available(), reason="pins the CPU and no-GPU answers")
def test_train_procs_is_one_per_visible_gpu_one_on_the_cpu_or_the_number_set(monkeypatch, tmp_path):
    settings = lambda **kw: load_settings(TrainerSettings, model_dir=tmp_path, **kw)
    assert train_procs(settings(device="cpu")) == 1
    assert train_procs(settings(device="cpu", train_procs=3)) == 3
    assert train_procs(settings(device="cuda")) == 1  # auto with no GPU visible
    with pytest.raises(SettingsError, match="DRAFTLINE_TRAIN_PROCS=2: only 0 GPUs"):
        train_procs(settings(device="cuda", train_procs=2))
    monkeypatch.setenv("DRAFTLINE_TRAIN_PROCS", "0")
    with pytest.raises(SettingsError, match="DRAFTLINE_TRAIN_PROCS: .*neither 'auto' nor a whole number"):
        load_settings(TrainerSettings, model_dir=tmp_path)
