"""The trainer's progress report into the run's Redis metadata: the fields the status page and the exporter
read back (tests/services/controller/runs/test_status.py, tests/services/exporter/test_collector.py)."""

from __future__ import annotations

from runtime.runstate import RunState
from services.controller.runs.status import run_status
from services.trainer.progress import progress_reporter
from services.trainer.train import TrainProgress


def test_the_report_writes_loss_accuracy_and_the_held_out_curve_where_there_is_one(redis_conn, data_dir):
    state = RunState(redis_conn, data_dir, "r1")
    report = progress_reporter(state)
    report(TrainProgress(step=3, total=10, epoch=0, loss=2.5, acc=[0.5, 0.25], lr=1e-3, tokens_per_s=100.0))
    meta = state.meta()
    assert (meta["train_done"], meta["train_total"], meta["train_acc1"]) == ("3", "10", "0.25")
    assert not any(field.startswith("train_val_accept") for field in meta)
    report(TrainProgress(step=4, total=10, epoch=0, loss=2.0, acc=[0.5, 0.3], lr=1e-3,
                         validation={"1": 1.41234, "2": 1.6}))
    meta = state.meta()
    assert (meta["train_val_accept1"], meta["train_val_accept2"]) == ("1.4123", "1.6")
    assert run_status(data_dir, redis_conn, "r1")["stages"]["train"]["validation"] == {"1": 1.4123, "2": 1.6}
