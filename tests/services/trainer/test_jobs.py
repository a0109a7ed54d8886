"""The trainer as it runs in production: ``draftline serve trainer``, a real RQ worker on a real Redis."""

from __future__ import annotations

import json
import time

import pytest
import torch
from rq.job import Job, JobStatus
from safetensors.torch import load_file

from modeling.export import verify_export
from services.trainer.jobs import too_small_warning
from shared.atomic import temp_files
from shared.jobs import TRAIN_FUNC, TRAIN_QUEUE, TrainJob, evaluate_job_id, train_job_id
from runtime.queues import SERIALIZER, queue
from runtime.runstate import RunState
from tests.support.acceptance import assert_report_matches, expected_report_of_run
from tests.support.processes import ServiceProcess

TRAIN = {"epochs": 3, "batch_size": 4, "ttt_steps": 2, "save_every": 5, "lr": 1e-2}
EVALUATE = {"max_new_tokens": 12, "draft_steps": 3}  # keyword names of expected_report_of_run too
BOTH_SETS = {"humaneval_limit": 1, "curve_max_steps": 3}  # both sets, a short curve: what the job records
HOLDOUT_ONLY = {"sets": ["holdout"], "curve_max_steps": 1, "baselines": False}


def worker(redis_url, data_dir, model_dir, log_dir) -> ServiceProcess:
    env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_MODEL_DIR": str(model_dir),
           "DRAFTLINE_DEVICE": "cpu", "DRAFTLINE_LOG_LEVEL": "INFO"}
    return ServiceProcess("trainer", env=env, log_dir=log_dir)


def enqueue_train(conn, run: str) -> None:
    queue(TRAIN_QUEUE, conn).enqueue_call(TRAIN_FUNC, args=(TrainJob(run=run).model_dump(),), job_id=train_job_id(run), timeout=600)


def wait_for(conn, job_id: str, service: ServiceProcess, statuses: set, timeout: float = 180.0) -> Job:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert service.alive(), f"trainer exited:\n{service.log()}"
        if conn.exists(Job.key_for(job_id)):
            job = Job.fetch(job_id, connection=conn, serializer=SERIALIZER)
            if job.get_status() in statuses:
                return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not reach {statuses} in {timeout}s:\n{service.log()}")


def test_worker_trains_exports_and_then_evaluates_the_run(make_run, redis_url, redis_conn, data_dir, tiny_model_dir, tmp_path):
    paths = make_run("served", train=TRAIN, evaluate={**EVALUATE, **BOTH_SETS})
    with worker(redis_url, data_dir, tiny_model_dir, tmp_path / "logs") as service:
        enqueue_train(redis_conn, "served")
        job = wait_for(redis_conn, evaluate_job_id("served"), service, {JobStatus.FINISHED, JobStatus.FAILED})
        assert job.get_status() == JobStatus.FINISHED, f"{job.latest_result().exc_string}\n{service.log()}"
    config = verify_export(paths.export_dir)
    assert config["draftline"]["target_model"] == "tiny" and config["torch_dtype"] == "float32"  # the target's dtype
    report = json.loads(paths.eval_report.read_text())
    assert report["steps"] > 0 and len(report["prompts"]) == 4 and report["headline_set"] == "holdout"
    assert_report_matches(report, expected_report_of_run(tiny_model_dir, paths.export_dir, paths.eval_prompts, **EVALUATE))
    assert list(report["sets"]) == ["holdout", "humaneval"] and len(report["sets"]["humaneval"]["prompts"]) == 1
    meta = RunState(redis_conn, data_dir, "served").meta()
    for name, one in report["sets"].items():
        assert one["greedy_check"]["matched"] == one["greedy_check"]["checked"] == len(one["prompts"]) * 7
        for k in ("1", "2", "3"):  # the curve as run meta fields, for the exporter
            assert float(meta[f"evaluate_accept.{name}.drafter.{k}"]) == one["methods"]["drafter"]["curve"][k]
            assert float(meta[f"evaluate_accept.{name}.lookup.{k}"]) == one["methods"]["lookup"]["curve"][k]
        assert float(meta[f"evaluate_accept.{name}.no_drafter.0"]) == 1.0
    assert meta["train_state"] == "done" and meta["evaluate_state"] == "done"
    assert meta["export_path"] == str(paths.export_dir)
    assert float(meta["acceptance_length"]) == pytest.approx(report["acceptance_length"])
    k = str(report["draft_steps"])  # the headline's margin over prompt lookup, for the status line
    margin = report["over_lookup"][k]
    assert float(meta["evaluate_lookup_acceptance"]) == report["methods"]["lookup"]["curve"][k]
    assert float(meta["evaluate_over_lookup"]) == pytest.approx(margin["difference"])
    assert meta["evaluate_over_lookup_low"] == meta["evaluate_over_lookup_high"] == ""  # 4 prompts: no interval
    assert int(meta["evaluate_over_lookup_prompts"]) == len(report["prompts"]) and meta["evaluate_k"] == k
    assert meta["train_done"] == meta["train_total"] == "12" and float(meta["train_loss"]) > 0
    assert meta["evaluate_done"] == meta["evaluate_total"] == "5"  # four held-out prompts and one of HumanEval
    assert len(paths.train_log.read_text().splitlines()) == 12
    learned = sum(int(load_file(p)["loss_mask"].sum()) for p in paths.hidden_dir.glob("rows_*/*.safetensors"))
    assert int(meta["train_loss_tokens"]) == learned and meta["train_warning"] == too_small_warning(learned) != ""
    assert temp_files(paths.root) == []


def test_a_corrupt_hidden_state_file_fails_the_train_job_naming_the_file(make_run, redis_url, redis_conn, data_dir, tiny_model_dir, tmp_path):
    paths = make_run("broken", train=TRAIN, evaluate=EVALUATE)
    victim = paths.hidden(7)
    victim.write_bytes(victim.read_bytes()[:-64])
    with worker(redis_url, data_dir, tiny_model_dir, tmp_path / "logs") as service:
        enqueue_train(redis_conn, "broken")
        job = wait_for(redis_conn, train_job_id("broken"), service, {JobStatus.FINISHED, JobStatus.FAILED})
    assert job.get_status() == JobStatus.FAILED
    meta = RunState(redis_conn, data_dir, "broken").meta()
    assert meta["train_state"] == "failed"
    assert meta["train_error"].startswith("HiddenStateFileError") and str(victim) in meta["train_error"]
    assert not paths.export_dir.exists() and not redis_conn.exists(Job.key_for(evaluate_job_id("broken")))


def test_evaluation_without_held_out_prompts_fails_naming_the_missing_file(job_settings, make_run, redis_conn, data_dir):
    from shared.errors import DatasetError

    paths = make_run("no-prompts", train=TRAIN, evaluate={**EVALUATE, **HOLDOUT_ONLY})
    (paths.root / "eval_prompts.jsonl").unlink()
    with pytest.raises(DatasetError, match="eval_prompts.jsonl"):
        job_settings.evaluate({"run": "no-prompts"})
    meta = RunState(redis_conn, data_dir, "no-prompts").meta()
    assert meta["evaluate_state"] == "failed" and meta["evaluate_error"].startswith("DatasetError")


def test_a_run_that_held_nothing_out_skips_evaluation(job_settings, make_run, redis_conn, data_dir):
    make_run("no-holdout", train=TRAIN, evaluate={**EVALUATE, **HOLDOUT_ONLY, "holdout": 0})
    assert job_settings.evaluate({"run": "no-holdout"})["acceptance_length"] is None
    assert RunState(redis_conn, data_dir, "no-holdout").meta()["evaluate_state"] == "skipped"


def test_a_decode_that_departs_from_greedy_fails_the_job_after_the_report_is_written(
    job_settings, make_run, redis_conn, data_dir, tiny_target, monkeypatch
):
    from evaluation import speculative_batch
    from modeling.export import export_drafter
    from modeling.eagle3 import DrafterConfig, Eagle3Drafter
    from modeling.target_head import load_target_head, read_target_config
    from shared.errors import SpeculativeMismatch
    from tests.support.tiny_runs import LAYER_IDS

    paths = make_run("departs", train=TRAIN, evaluate={**EVALUATE, **HOLDOUT_ONLY})
    torch.manual_seed(2)
    config = DrafterConfig.from_target_config(read_target_config(tiny_target.model_dir), draft_vocab_size=256, layer_ids=LAYER_IDS)
    drafter = Eagle3Drafter(config)
    drafter.load_embedding(load_target_head(tiny_target.model_dir).embed)
    drafter.set_vocab_mapping(torch.zeros(256, dtype=torch.int64), torch.arange(config.vocab_size) < 256)  # ids 0..255
    export_drafter(drafter, paths.export_dir, target_model="tiny", target_fingerprint=tiny_target.fingerprint)
    # An accept rule that takes every draft: the random drafter's wrong drafts reach the output.
    monkeypatch.setattr(speculative_batch, "accepted_prefix", lambda drafts, greedy: len(drafts))
    with pytest.raises(SpeculativeMismatch, match=r"set holdout, prompt \d+, method drafter, k 1, first differing position"):
        job_settings.evaluate({"run": "departs"})
    report = json.loads(paths.eval_report.read_text())  # written before the failure: the numbers stay readable
    assert report["sets"]["holdout"]["greedy_check"]["mismatches"]
    meta = RunState(redis_conn, data_dir, "departs").meta()
    assert meta["evaluate_state"] == "failed" and meta["evaluate_error"].startswith("SpeculativeMismatch")


def test_a_missing_run_is_a_named_train_failure(job_settings, redis_conn, data_dir):
    from shared.errors import RunNotFound

    with pytest.raises(RunNotFound):
        job_settings.train({"run": "ghost"})
    assert RunState(redis_conn, data_dir, "ghost").meta()["train_error"].startswith("RunNotFound")
