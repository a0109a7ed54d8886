"""Capture once, train many: a retrain is a new run on the volume made of the source's capture (hard links),
which the controller picks up like any run and sends to training; what the capture fixed cannot change."""

from __future__ import annotations

import json
import os

import pytest
from pydantic import ValidationError

from services.controller.loop.reconcile import lost_runs, reconcile_run
from services.controller.loop.supervisor import supervise_once
from services.controller.runs.retrain import RetrainRefused, retrain_run
from services.controller.runs.status import run_status
from runtime.runstate import RunState, known_runs
from shared.errors import RunExists
from shared.jobs import TRAIN_QUEUE, train_job_id
from shared.layout import RunPaths
from shared.lifecycle import RunKeys, RunPhase, StageState
from runtime.queues import queue
from shared.runspec import RunSpec
from shared.settings import ControllerSettings
from tests.services.cli.test_resume_failures_retry import draftline
from tests.services.controller.volume import finish_samples, prompt_rows, submit

SOURCE = "src"


def cfg(data_dir) -> ControllerSettings:
    return ControllerSettings(data=data_dir, feed_batch=2, max_queued_jobs=100)


@pytest.fixture()
def captured(data_dir, redis_conn, tmp_path) -> RunState:
    """A finished capture: 20 rows, row 15 malformed, the last 2 held out; the other 17 extracted, in training."""
    state = submit(data_dir, redis_conn, tmp_path, SOURCE, prompt_rows(20, bad=(15,)), holdout=2)
    ids = [i for i in range(18) if i != 15]
    finish_samples(state, generated=ids, extracted=ids)
    reconcile_run(data_dir, redis_conn, SOURCE)
    supervise_once(cfg(data_dir), redis_conn)
    assert state.meta()["state"] == "training"
    (state.paths.root / "drafter").mkdir()  # the source's own training: never part of a retrain
    return state


def test_a_retrain_shares_the_capture_changes_only_training_and_the_controller_trains_it(data_dir, redis_conn,
                                                                                       captured):
    spec = retrain_run(data_dir, redis_conn, SOURCE, "again", {"train": {"lr": 1e-3, "epochs": 3},
                                                                "evaluate": {"draft_steps": 4}}).spec
    source, again = RunSpec.load(data_dir, SOURCE), RunSpec.load(data_dir, "again")
    assert again == spec and (again.train.lr, again.train.epochs, again.evaluate.draft_steps) == (1e-3, 3, 4)
    assert again.model_dump(exclude={"name", "created_at", "train", "evaluate"}) == \
        source.model_dump(exclude={"name", "created_at", "train", "evaluate"})
    assert again.train.ttt_steps == source.train.ttt_steps and again.created_at > source.created_at
    new, old = RunPaths(data_dir, "again"), captured.paths
    for sample_id in (0, 17):  # the same files, not copies: no byte of the capture written twice
        assert os.stat(new.hidden(sample_id)).st_ino == os.stat(old.hidden(sample_id)).st_ino
        assert os.stat(new.generated(sample_id)).st_ino == os.stat(old.generated(sample_id)).st_ino
    assert new.prompts.read_bytes() == old.prompts.read_bytes()
    assert new.eval_prompts.read_bytes() == old.eval_prompts.read_bytes()  # measured on the source's held-out rows
    assert not (new.root / "drafter").exists() and not list(data_dir.glob(".retrain-*"))
    # The controller finds it on the volume, rebuilds it (every sample settled) and enqueues its training.
    supervise_once(cfg(data_dir), redis_conn)
    assert "again" in known_runs(redis_conn)
    supervise_once(cfg(data_dir), redis_conn)
    assert RunState(redis_conn, data_dir, "again").meta()["state"] == "training"
    assert train_job_id("again") in queue(TRAIN_QUEUE, redis_conn).job_ids
    status = run_status(data_dir, redis_conn, "again")
    assert status["stages"]["extract"]["done"] == 17 and status["stages"]["generate"]["failed"] == 1  # row 15, named
    # Either run's files outlive the other's deletion.
    old.hidden(0).unlink()
    assert new.hidden(0).stat().st_size > 0


def test_what_the_capture_fixed_cannot_change_and_nothing_is_laid_down_when_refused(data_dir, redis_conn,
                                                                                  captured):
    for sections, named in (({"generation": {"max_tokens": 9}}, "generation"),
                            ({"extraction": {"storage": "fp8"}}, "extraction"),
                            ({"evaluate": {"holdout": 5}}, "evaluate.holdout")):
        with pytest.raises(RetrainRefused, match=named):
            retrain_run(data_dir, redis_conn, SOURCE, "x", sections)
    with pytest.raises(ValidationError, match="lr"):
        retrain_run(data_dir, redis_conn, SOURCE, "x", {"train": {"lr": -1}})
    with pytest.raises(ValueError, match="invalid run name"):
        retrain_run(data_dir, redis_conn, SOURCE, "../x", {})
    with pytest.raises(RunExists):
        retrain_run(data_dir, redis_conn, SOURCE, SOURCE, {})
    assert not RunPaths(data_dir, "x").root.exists() and not list(data_dir.glob(".retrain-*"))
    # The held-out count as it is, repeated, changes nothing and is accepted.
    holdout = RunSpec.load(data_dir, SOURCE).evaluate.holdout
    assert retrain_run(data_dir, redis_conn, SOURCE, "same", {"evaluate": {"holdout": holdout}}).spec.evaluate.holdout == 2


def test_a_run_whose_training_failed_is_trained_again_with_smaller_batches(data_dir, redis_conn, captured):
    # The README's fix for a trainer out of GPU memory: the capture is whole, only its training failed.
    captured.set_stage("train", StageState.FAILED, train_error="OutOfMemoryError: CUDA out of memory")
    captured.set_phase(RunPhase.FAILED)
    assert run_status(data_dir, redis_conn, SOURCE)["state"] == "failed"
    spec = retrain_run(data_dir, redis_conn, SOURCE, "smaller", {"train": {"max_tokens": 16384}}).spec
    assert spec.train.max_tokens == 16384 and RunSpec.load(data_dir, SOURCE).train.max_tokens is None
    supervise_once(cfg(data_dir), redis_conn)
    supervise_once(cfg(data_dir), redis_conn)
    assert RunState(redis_conn, data_dir, "smaller").meta()["state"] == "training"
    assert train_job_id("smaller") in queue(TRAIN_QUEUE, redis_conn).job_ids


def test_an_online_retrain_links_the_replies_not_the_states_and_goes_to_training(data_dir, redis_conn, captured):
    spec = retrain_run(data_dir, redis_conn, SOURCE, "again-online",
                       {"online": {"enabled": True, "budget_bytes": 10**6}}).spec
    assert spec.online.enabled and spec.online.budget_bytes == 10**6
    new, old = RunPaths(data_dir, "again-online"), captured.paths
    assert os.stat(new.generated(0)).st_ino == os.stat(old.generated(0)).st_ino
    assert not list(new.hidden_dir.rglob("*.safetensors"))  # extracted again as the trainer asks
    supervise_once(cfg(data_dir), redis_conn)
    supervise_once(cfg(data_dir), redis_conn)
    assert RunState(redis_conn, data_dir, "again-online").meta()["state"] == "training"
    assert train_job_id("again-online") in queue(TRAIN_QUEUE, redis_conn).job_ids
    unset = retrain_run(data_dir, redis_conn, SOURCE, "budget-unset", {"online": {"enabled": True}}).spec
    assert unset.online.budget_bytes and unset.online.budget_bytes > 0  # a quarter of the free space, fixed now


def test_the_supervisor_leaves_a_run_being_laid_to_its_registration(data_dir, redis_conn, captured):
    # CI once saw the API's registration refused as busy: the supervisor's pass had found the new directory on
    # the volume, not yet in Redis, and was reconciling it at the same moment.
    def register(data, conn, name):
        assert RunPaths(data, name).spec.is_file() and name not in known_runs(conn)  # laid, not yet registered
        assert name not in lost_runs(data, conn)  # so a supervisor pass now leaves it alone
        supervise_once(cfg(data), conn)
        assert name not in known_runs(conn)
        return reconcile_run(data, conn, name)

    spec, report = retrain_run(data_dir, redis_conn, SOURCE, "racing", {}, register=register)
    assert report.run == "racing" and report.extracted == 17 and spec.name == "racing"
    assert not redis_conn.exists(RunKeys("racing").submit_lock)
    assert RunState(redis_conn, data_dir, "racing").meta()["expected"] == str(report.expected)


def test_a_capture_still_under_way_is_refused(data_dir, redis_conn, tmp_path):
    submit(data_dir, redis_conn, tmp_path, "busy", prompt_rows(6))
    with pytest.raises(RetrainRefused, match="still"):
        retrain_run(data_dir, redis_conn, "busy", "early", {})
    assert not RunPaths(data_dir, "early").root.exists()


def test_the_command_lays_the_run_and_registers_it_at_once(data_dir, redis_conn, redis_url, captured, tmp_path):
    env = {**os.environ, "REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir)}
    config = tmp_path / "recipe.json"
    config.write_text(json.dumps({"train": {"ttt_steps": 5, "lr": 5e-4}}))
    done = draftline(env, "retrain", SOURCE, "--name", "ttt5", "--run-config", str(config), "--lr", "0.001")
    assert done.returncode == 0, done.stderr
    assert "17 of 18 samples from src's capture" in done.stdout  # row 15 malformed: its failure kept
    assert "1 failures kept" in done.stdout and "changed train.ttt_steps=5, train.lr=0.001" in done.stdout
    spec = RunSpec.load(data_dir, "ttt5")
    assert (spec.train.ttt_steps, spec.train.lr) == (5, 1e-3)  # the flag over the file
    assert "ttt5" in known_runs(redis_conn)
    refused = draftline(env, "retrain", SOURCE, "--name", "other", "--run-config", str(config.with_name("x.json")))
    assert refused.returncode != 0 and "x.json" in refused.stderr
