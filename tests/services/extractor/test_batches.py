"""Extract jobs of several samples, run by real ``draftline serve extractor`` processes against the built-in
server on the tiny target: each sample settles on its own, and a killed job redoes only what it had not finished."""

from __future__ import annotations

import json
import os
import signal

import pytest
from rq.job import Job

from services.controller.loop.reaper import requeue_abandoned
from services.controller.runs.submit import submit_run
from shared import SCHEMA_VERSION
from shared.atomic import atomic_write_json
from shared.hidden_file import verify_hidden_file
from shared.jobs import EXTRACT_QUEUE, extract_job_id
from shared.manifest import manifest_path, read_manifest
from runtime.queues import queue
from shared.runspec import EvalConfig, RunSpec
from runtime.runstate import RunState
from runtime.sample_queue import enqueue_extract
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.runtime.test_worker import horse_of, wait_for
from tests.support.processes import ServiceProcess, free_port
from tests.support.slow_proxy import SlowProxy
from tests.support.workers import successful_jobs


@pytest.fixture(scope="module")
def inference(tiny_model_dir, tmp_path_factory):
    """The built-in server on the tiny target, writing onto the module's volume."""
    volume = tmp_path_factory.mktemp("batches") / "data"
    volume.mkdir()
    port = free_port()
    env = {"DRAFTLINE_MODEL_DIR": str(tiny_model_dir), "DRAFTLINE_DATA": str(volume), "DRAFTLINE_PORT": str(port),
           "DRAFTLINE_HOST": "127.0.0.1", "DRAFTLINE_DEVICE": "cpu"}
    with ServiceProcess("inference", env=env, log_dir=tmp_path_factory.mktemp("logs"),
                        health_url=f"http://127.0.0.1:{port}/health"):
        yield {"url": f"http://127.0.0.1:{port}", "volume": volume}


@pytest.fixture()
def data_dir(inference):
    """Every test's runs live on the volume the inference server writes to."""
    return inference["volume"]


def make_run(data_dir, conn, tmp_path, name: str, samples: int) -> RunState:
    """A submitted run whose samples 0..samples-1 have replies on the volume (one more row is held out)."""
    dataset = write_jsonl(tmp_path / f"{name}.jsonl", [{"prompt": f"Count to {i + 1}."} for i in range(samples + 1)])
    submit_run(data_dir, conn, RunSpec(dataset=str(dataset), name=name, model="tiny", evaluate=EvalConfig(holdout=1)))
    state = RunState(conn, data_dir, name)
    for sample_id in range(samples):
        atomic_write_json(state.paths.generated(sample_id), {
            "schema_version": SCHEMA_VERSION, "sample_id": sample_id,
            "messages": [{"role": "user", "content": f"Count to {sample_id + 1}."}],
            "reply": {"content": " ".join(str(n) for n in range(1, sample_id + 2)), "reasoning_content": None},
            "usage": {"completion_tokens": sample_id + 1}, "finish_reason": "stop", "model": "tiny",
        })
        state.mark_done("generate", sample_id)
    return state


def extractor(redis_url, data_dir, tiny_model_dir, url: str, tmp_path, job_process: str = "inline") -> ServiceProcess:
    env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_MODEL_DIR": str(tiny_model_dir),
           "DRAFTLINE_HIDDEN_STATES_URL": url, "DRAFTLINE_JOB_PROCESS": job_process}
    return ServiceProcess("extractor", env=env, log_dir=tmp_path / "logs")


def settled(state: RunState) -> int:
    counts = state.counts("extract")
    return counts.done + counts.failed


def manifest_count(state: RunState, sample_id: int) -> int:
    """How many times the sample's file was recorded: once per extraction that finished."""
    path = manifest_path(state.paths, sample_id)
    lines = path.read_text().splitlines() if path.is_file() else []
    return sum(json.loads(line)["sample_id"] == sample_id for line in lines)


def test_a_failing_sample_of_a_batch_is_named_and_the_others_are_extracted(inference, data_dir, redis_url, redis_conn,
                                                                           tmp_path, tiny_model_dir):
    state = make_run(data_dir, redis_conn, tmp_path, "one-bad", 5)
    state.paths.generated(2).write_text('{"sample_id": 2, "messages": ')  # a torn reply file
    assert enqueue_extract(redis_conn, "one-bad", range(5), batch=16) == [[0, 1, 2, 3, 4]]
    with extractor(redis_url, data_dir, tiny_model_dir, inference["url"], tmp_path) as worker:
        wait_for(lambda: settled(state) == 5, "every sample of the batch settled", 120, worker)
        wait_for(lambda: sum(successful_jobs(redis_conn).values()) == 1, "the job finished", 30, worker)
    counts = state.counts("extract")
    assert (counts.done, counts.failed) == (4, 1)
    (failure,) = state.failures("extract")
    assert (failure.sample_id, failure.error_class) == (2, "GeneratedFileError")
    assert state.paths.failure("extract", 2).is_file()  # named on the volume
    for sample_id in (0, 1, 3, 4):
        verify_hidden_file(state.paths.hidden(sample_id), layer_ids=[1, 3, 4])
    assert not state.paths.hidden(2).exists()
    assert queue(EXTRACT_QUEUE, redis_conn).failed_job_registry.count == 0  # the job itself succeeded


@pytest.mark.parametrize("job_process", ["fork", "inline"])
def test_a_batch_killed_mid_way_is_requeued_and_redoes_only_its_unfinished_samples(
        inference, data_dir, redis_url, redis_conn, tmp_path, tiny_model_dir, job_process):
    """Fork: the OOM killer's SIGKILL of the work horse, requeued by its worker. Inline: the SIGKILL of the
    worker running the job, requeued by the reaper once its heartbeat is stale, and run by another worker."""
    samples, run = 8, f"killed-{job_process}"
    state = make_run(data_dir, redis_conn, tmp_path, run, samples)
    enqueue_extract(redis_conn, run, range(samples), batch=16)
    with SlowProxy(inference["url"], delay_s=0.7) as proxy:
        with extractor(redis_url, data_dir, tiny_model_dir, proxy.url, tmp_path, job_process) as worker:
            wait_for(lambda: state.counts("extract").done >= 3, "some samples of the batch extracted", 120, worker)
            os.kill(horse_of(worker) if job_process == "fork" else worker.proc.pid, signal.SIGKILL)
            finished = [i for i in range(samples) if state.is_done("extract", i)]
            written = {i: state.paths.hidden(i).stat().st_mtime_ns for i in finished}
            assert len(finished) < samples, "the batch finished before the kill; the test proves nothing"
            if job_process == "fork":
                wait_for(lambda: state.counts("extract").done == samples, "the requeued batch finished", 120, worker)
                wait_for(lambda: sum(successful_jobs(redis_conn).values()) == 1, "the job finished", 30, worker)
                assert "killed by SIGKILL; requeued at the front" in worker.full_log()
        if job_process == "inline":
            with extractor(redis_url, data_dir, tiny_model_dir, proxy.url, tmp_path, job_process) as worker:
                def reaped_and_finished() -> bool:
                    requeue_abandoned(redis_conn)  # what the supervisor does every few seconds
                    return state.counts("extract").done == samples
                wait_for(reaped_and_finished, "the reaped batch finished", 180, worker)
                wait_for(lambda: sum(successful_jobs(redis_conn).values()) == 1, "the job finished", 30, worker)
    for sample_id in finished:  # extracted before the kill: never asked for, written or recorded again
        assert proxy.requests[sample_id] == 1, proxy.requests
        assert state.paths.hidden(sample_id).stat().st_mtime_ns == written[sample_id]
        assert manifest_count(state, sample_id) == 1
    sizes = 0
    for sample_id in range(samples):
        info = verify_hidden_file(state.paths.hidden(sample_id), layer_ids=[1, 3, 4])
        assert read_manifest(manifest_path(state.paths, sample_id))[sample_id].sha256 == info.sha256
        sizes += info.nbytes
    counts = state.counts("extract")
    assert (counts.done, counts.failed) == (samples, 0)  # each sample counted once ...
    assert int(float(state.meta()["hidden_bytes"])) == sizes  # ... and its bytes too
    assert not redis_conn.exists(Job.key_for(extract_job_id(run, 0)))  # finished, so deleted at once
    assert float(state.meta()["extract_retried"]) == samples  # one requeue: a retry of each sample of the job
