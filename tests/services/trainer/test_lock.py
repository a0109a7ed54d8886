"""One trainer per run: a second one (another process, or a requeued copy of the job) is refused by name
and leaves the run alone; the lock goes with its holder, however the holder ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from services.trainer.lock import TrainingInProgress, exclusive_training, lock_path
from shared.layout import RunPaths
from runtime.runstate import RunState
from tests.support.processes import REPO

HOLD = """
import sys, time
from pathlib import Path
from services.trainer.lock import TrainingInProgress, exclusive_training
from shared.layout import RunPaths
try:
    with exclusive_training(RunPaths(Path(sys.argv[1]), sys.argv[2])):
        print("held", flush=True)
        time.sleep(float(sys.argv[3]))
except TrainingInProgress as exc:
    print("refused:", exc, flush=True)
"""


def hold_in_process(data, run: str, seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLD, str(data), run, str(seconds)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, start_new_session=True)


def test_a_second_process_is_refused_while_the_first_holds_the_run(data_dir):
    holder = hold_in_process(data_dir, "busy", 60)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TrainingInProgress, match="'busy' is being trained by another worker"):
            with exclusive_training(RunPaths(data_dir, "busy")):
                pass
        with exclusive_training(RunPaths(data_dir, "other")):  # other runs are not affected
            pass
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    # SIGKILL gives no chance to clean up; the kernel releases the lock with the process.
    with exclusive_training(RunPaths(data_dir, "busy")):
        refused = hold_in_process(data_dir, "busy", 0)
        assert refused.communicate(timeout=60)[0].startswith("refused:")
    assert lock_path(RunPaths(data_dir, "busy")).is_file()


def test_a_train_job_for_a_run_in_training_fails_by_name_and_changes_nothing(job_settings, make_run, redis_conn, data_dir):
    paths = make_run("held", train={"epochs": 1})
    state = RunState(redis_conn, data_dir, "held")
    state.set_meta(train_state="running", train_done=3)
    with exclusive_training(paths):
        started = time.monotonic()
        with pytest.raises(TrainingInProgress):
            job_settings.train({"run": "held"})
        assert time.monotonic() - started < 30  # refused at once, not after waiting for the holder
    meta = state.meta()
    assert meta["train_state"] == "running" and meta["train_done"] == "3" and "train_error" not in meta
    assert not paths.train_log.exists() and not paths.checkpoints_dir.exists()
    assert job_settings.train({"run": "held"})["steps"] == 4  # once the holder is gone, training goes ahead
