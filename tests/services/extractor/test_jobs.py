"""The extract job against the real built-in inference server (``draftline serve inference``) on the tiny target."""

from __future__ import annotations

import json
import signal
import time

import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from services.controller.runs.submit import submit_run
from services.extractor.client import HiddenStatesClient
from services.extractor.jobs import load_tokenizer, run_extract
from shared.sample_tokens import build_sample
from shared import SCHEMA_VERSION
from shared.atomic import atomic_write_json
from shared.hidden_file import verify_hidden_file
from rq.job import Job

from runtime import disk
from runtime.queues import SERIALIZER, queue
from runtime.requeue import REQUEUES_META
from runtime.shutdown import DRAIN_DEADLINE_S
from shared.jobs import EXTRACT_QUEUE, ExtractJob, extract_job_id
from shared.manifest import manifest_path, read_manifest
from shared.runspec import EvalConfig, ExtractionConfig, RunSpec
from runtime.runstate import RunState
from runtime.sample_queue import enqueue_extract
from shared.settings import ExtractorSettings
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.runtime.test_worker import EXIT_AFTER_JOB_S, wait_for
from tests.support.processes import ServiceProcess, free_port

REPLIES = {
    0: ("Binary search halves the list each time.", None),
    1: ("Four.", "Two plus two is four."),
    2: ("Seven, eleven and thirteen.", "List three primes."),
}


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    return tmp_path_factory.mktemp("extract") / "data"


@pytest.fixture(scope="module")
def inference(volume, tiny_model_dir, tmp_path_factory):
    volume.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {"DRAFTLINE_MODEL_DIR": str(tiny_model_dir), "DRAFTLINE_DATA": str(volume), "DRAFTLINE_PORT": str(port),
           "DRAFTLINE_HOST": "127.0.0.1", "DRAFTLINE_DEVICE": "cpu"}
    with ServiceProcess("inference", env=env, log_dir=tmp_path_factory.mktemp("logs"),
                        health_url=f"http://127.0.0.1:{port}/health") as proc:
        yield {"url": f"http://127.0.0.1:{port}", "proc": proc}


@pytest.fixture()
def data_dir(volume):
    """Every test's runs live on the volume the inference server writes to."""
    return volume


def settings(data_dir, redis_url, tiny_model_dir, url: str) -> ExtractorSettings:
    return ExtractorSettings(data=data_dir, redis_url=redis_url, model_dir=tiny_model_dir, hidden_states_url=url,
                             request_timeout_s=60)


def make_run(data_dir, conn, tmp_path, name: str, *, extraction: ExtractionConfig | None = None) -> RunState:
    """A submitted run whose samples 0-2 already have replies on the volume."""
    prompts = ["Explain a binary search.", "What is 2 + 2?", "Name three primes.", "held out"]
    dataset = write_jsonl(tmp_path / f"{name}.jsonl", [{"prompt": p} for p in prompts])
    submit_run(data_dir, conn, RunSpec(dataset=str(dataset), name=name, model="tiny", extraction=extraction or ExtractionConfig(),
                                       evaluate=EvalConfig(holdout=1)))
    state = RunState(conn, data_dir, name)
    for sample_id, (content, reasoning) in REPLIES.items():
        atomic_write_json(state.paths.generated(sample_id), {
            "schema_version": SCHEMA_VERSION, "sample_id": sample_id,
            "messages": [{"role": "user", "content": prompts[sample_id]}],
            "reply": {"content": content, "reasoning_content": reasoning},
            "usage": {"completion_tokens": 5}, "finish_reason": "stop", "model": "tiny",
        })
        state.mark_done("generate", sample_id)
    return state


def extract(state: RunState, sample_id: int, cfg: ExtractorSettings, conn, *, retry_delays_s=(0.05,)) -> str:
    client = HiddenStatesClient(cfg.hidden_states_url, timeout_s=cfg.request_timeout_s, retry_delays_s=retry_delays_s)
    tokenizer = load_tokenizer(str(cfg.model_dir))
    (outcome,) = run_extract(ExtractJob(run=state.run, sample_ids=[sample_id]), cfg, conn, tokenizer, client)
    return outcome


def test_extract_writes_a_verified_file_with_our_tokens_and_mask(inference, data_dir, redis_url, redis_conn, tmp_path,
                                                                 tiny_model_dir):
    state = make_run(data_dir, redis_conn, tmp_path, "ok")
    cfg = settings(data_dir, redis_url, tiny_model_dir, inference["url"])
    assert [extract(state, i, cfg, redis_conn) for i in (0, 1, 2)] == ["done"] * 3
    tokenizer = load_tokenizer(str(tiny_model_dir))
    sizes = 0
    for sample_id, (content, reasoning) in REPLIES.items():
        path = state.paths.hidden(sample_id)
        assert path.parent.name == "rows_000000-001999"
        info = verify_hidden_file(path, layer_ids=[1, 3, 4], hidden_size=64)
        tensors = load_file(path)
        ids, mask = build_sample(tokenizer, json.loads(state.paths.generated(sample_id).read_text())["messages"],
                                 content, reasoning, 4096)
        assert tensors["input_ids"].tolist() == ids and tensors["loss_mask"].tolist() == mask
        assert info.num_tokens == len(ids)
        sizes += path.stat().st_size
    meta = state.meta()
    assert state.counts("extract").done == 3
    assert int(float(meta["hidden_bytes"])) == sizes
    assert json.loads(meta["layer_ids"]) == [1, 3, 4] and meta["layer_convention"] == "decoder_output_0idx"
    assert extract(state, 0, cfg, redis_conn) == "skipped"
    assert int(float(state.meta()["hidden_bytes"])) == sizes  # a repeated job never counts bytes twice


def test_run_layer_ids_reach_the_file(inference, data_dir, redis_url, redis_conn, tmp_path, tiny_model_dir):
    state = make_run(data_dir, redis_conn, tmp_path, "layers", extraction=ExtractionConfig(layer_ids=[0, 2, 5]))
    assert extract(state, 1, settings(data_dir, redis_url, tiny_model_dir, inference["url"]), redis_conn) == "done"
    assert verify_hidden_file(state.paths.hidden(1), layer_ids=[0, 2, 5]).layer_ids == [0, 2, 5]


def test_an_fp8_run_gets_verified_fp8_files_recorded_as_fp8_in_the_manifest(inference, data_dir, redis_url, redis_conn,
                                                                           tmp_path, tiny_model_dir):
    exact = make_run(data_dir, redis_conn, tmp_path, "exact-storage")
    fp8 = make_run(data_dir, redis_conn, tmp_path, "fp8-storage", extraction=ExtractionConfig(storage="fp8"))
    cfg = settings(data_dir, redis_url, tiny_model_dir, inference["url"])
    assert [extract(run, 0, cfg, redis_conn) for run in (exact, fp8)] == ["done", "done"]
    info = verify_hidden_file(fp8.paths.hidden(0), layer_ids=[1, 3, 4], dtype="F8_E4M3", hidden_size=64)
    (entry,) = read_manifest(manifest_path(fp8.paths, 0)).values()
    assert (entry.dtype, entry.bytes, entry.sha256) == ("F8_E4M3", info.nbytes, info.sha256)
    assert int(float(fp8.meta()["hidden_bytes"])) == info.nbytes
    with safe_open(fp8.paths.hidden(0), framework="pt") as handle:  # numpy has no fp8 dtype
        assert handle.get_tensor("input_ids").tolist() == load_file(exact.paths.hidden(0))["input_ids"].tolist()
    assert info.nbytes < exact.paths.hidden(0).stat().st_size / 3  # against the tiny target's fp32


class IgnoresStorage(HiddenStatesClient):
    """A server that writes its own dtype whatever the run asked for."""

    def extract(self, **kwargs):
        return super().extract(**{**kwargs, "storage": "target"})


def test_a_file_in_another_storage_than_the_runs_is_a_named_failure_and_removed(inference, data_dir, redis_url,
                                                                                redis_conn, tmp_path, tiny_model_dir):
    state = make_run(data_dir, redis_conn, tmp_path, "wrong-storage", extraction=ExtractionConfig(storage="fp8"))
    cfg = settings(data_dir, redis_url, tiny_model_dir, inference["url"])
    client = IgnoresStorage(cfg.hidden_states_url, timeout_s=cfg.request_timeout_s, retry_delays_s=(0.05,))
    job = ExtractJob(run=state.run, sample_ids=[0])
    assert run_extract(job, cfg, redis_conn, load_tokenizer(str(cfg.model_dir)), client) == ["failed"]
    (failure,) = state.failures("extract")
    assert failure.error_class == "HiddenStateFileError" and "states in F32, the run stores them as 'fp8'" in failure.message
    assert not state.paths.hidden(0).exists() and state.counts("extract").done == 0


def test_a_file_with_other_layers_than_the_runs_is_a_named_failure_and_removed(inference, data_dir, redis_url, redis_conn,
                                                                               tmp_path, tiny_model_dir):
    state = make_run(data_dir, redis_conn, tmp_path, "mixed")
    state.set_meta(layer_ids=json.dumps([0, 1, 2]))  # the run's first samples came from a server with other defaults
    assert extract(state, 0, settings(data_dir, redis_url, tiny_model_dir, inference["url"]), redis_conn) == "failed"
    (failure,) = state.failures("extract")
    assert failure.error_class == "HiddenStateFileError" and "run expects [0, 1, 2]" in failure.message
    assert not state.paths.hidden(0).exists()
    assert state.counts("extract").done == 0


def test_problems_become_named_extract_failures(inference, data_dir, redis_url, redis_conn, tmp_path, tiny_model_dir):
    state = make_run(data_dir, redis_conn, tmp_path, "bad", extraction=ExtractionConfig(max_length=8))
    cfg = settings(data_dir, redis_url, tiny_model_dir, inference["url"])
    state.paths.generated(2).unlink()
    assert extract(state, 0, cfg, redis_conn) == "failed"  # prompt longer than max_length
    assert extract(state, 2, cfg, redis_conn) == "failed"  # the reply file is gone
    down = settings(data_dir, redis_url, tiny_model_dir, f"http://127.0.0.1:{free_port()}")
    other = make_run(data_dir, redis_conn, tmp_path, "down")
    assert extract(other, 1, down, redis_conn) == "failed"
    failures = {(f.run, f.sample_id): f for f in state.failures("extract") + other.failures("extract")}
    assert failures[("bad", 0)].error_class == "PromptTooLong"
    assert failures[("bad", 2)].error_class == "GeneratedFileError" and "no reply file" in failures[("bad", 2)].message
    assert failures[("down", 1)].error_class == "InferenceUnavailable"


def test_extractor_worker_process_drains_the_queue(inference, data_dir, redis_url, redis_conn, tmp_path, tiny_model_dir):
    state = make_run(data_dir, redis_conn, tmp_path, "worker")
    enqueue_extract(redis_conn, "worker", REPLIES, batch=2)  # a batch of two and a batch of one
    env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_MODEL_DIR": str(tiny_model_dir),
           "DRAFTLINE_HIDDEN_STATES_URL": inference["url"]}
    with ServiceProcess("extractor", env=env, log_dir=tmp_path / "logs") as worker:
        deadline = time.monotonic() + 90
        while state.counts("extract").done < len(REPLIES) and time.monotonic() < deadline:
            assert worker.alive(), worker.log()
            assert not state.failures("extract"), state.failures("extract")
            time.sleep(0.2)
        assert state.counts("extract").done == len(REPLIES), worker.log()
    for sample_id in REPLIES:
        verify_hidden_file(state.paths.hidden(sample_id), layer_ids=[1, 3, 4])


def test_a_stopped_extractor_gives_back_its_job_waiting_on_a_paused_volume_and_the_job_run_again_extracts_the_rest(
        inference, data_dir, redis_url, redis_conn, tmp_path, tiny_model_dir):
    """The volume is full (the run paused) while a job of samples 0 and 1 runs: 0 was extracted before, 1 waits for
    space. A first SIGTERM ends the worker within the deadline, the job back at the front of its queue, nothing
    failed and nothing counted; once the pause lifts, the job run again extracts only sample 1."""
    state = make_run(data_dir, redis_conn, tmp_path, "stopped-while-paused")
    run = state.run
    assert extract(state, 0, settings(data_dir, redis_url, tiny_model_dir, inference["url"]), redis_conn) == "done"
    landed = state.meta()["hidden_bytes"]
    disk.set_paused(redis_conn, run, "the volume is full (the test's pause)")
    enqueue_extract(redis_conn, run, REPLIES, batch=2)  # samples 0 and 1, then 2
    waiting, behind = extract_job_id(run, 0), extract_job_id(run, 2)
    env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_MODEL_DIR": str(tiny_model_dir),
           "DRAFTLINE_HIDDEN_STATES_URL": inference["url"]}
    worker = ServiceProcess("extractor", env=env, log_dir=tmp_path / "logs").start()
    try:
        wait_for(lambda: "extraction waits for disk space" in worker.full_log(), "sample 1 waiting for space", 120,
                 worker)
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(DRAIN_DEADLINE_S + EXIT_AFTER_JOB_S) == 0, worker.log()
    finally:
        worker.stop(signal.SIGKILL)
    q = queue(EXTRACT_QUEUE, redis_conn)
    assert q.get_job_ids() == [waiting, behind]
    assert q.started_job_registry.get_job_ids(cleanup=False) == [] and q.failed_job_registry.get_job_ids() == []
    assert REQUEUES_META not in Job.fetch(waiting, connection=redis_conn, serializer=SERIALIZER).meta
    assert state.counts("extract").done == 1 and state.counts("extract").failed == 0 and state.failures() == []
    assert state.meta()["hidden_bytes"] == landed and "extract_retried" not in state.meta()
    assert f"job {waiting} yielded" in worker.full_log()

    disk.clear_paused(redis_conn, run)
    with ServiceProcess("extractor", env=env, log_dir=tmp_path / "logs") as worker:
        wait_for(lambda: state.counts("extract").done == len(REPLIES), "every sample extracted", 120, worker)
    assert "extract batch from 0: {'skipped': 1, 'done': 1}" in worker.full_log()
    assert state.failures() == [] and "extract_retried" not in state.meta()
    sizes = sum(state.paths.hidden(i).stat().st_size for i in REPLIES)
    assert int(float(state.meta()["hidden_bytes"])) == sizes  # each file counted once, across the stop


def engine_record(state: RunState, sample_id: int, token_ids) -> None:
    record = json.loads(state.paths.generated(sample_id).read_text())
    atomic_write_json(state.paths.generated(sample_id), {**record, "token_ids": token_ids})


def test_the_engines_own_token_ids_are_extracted_as_they_are(inference, data_dir, redis_url, redis_conn, tmp_path,
                                                            tiny_model_dir):
    state = make_run(data_dir, redis_conn, tmp_path, "engine", extraction=ExtractionConfig(max_length=40))
    tokenizer = load_tokenizer(str(tiny_model_dir))
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                                add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    # Ids no template would give for the recorded text: the file must hold the engine's ids, not a re-rendering.
    reply = [17, 17, 5, 9, 300, tokenizer.eos_token_id]
    engine_record(state, 1, {"prompt": prompt, "reply": reply})
    long_reply = list(range(40, 40 + 50))  # runs past max_length: cut, mask and ids alike
    engine_record(state, 0, {"prompt": prompt, "reply": long_reply})
    cfg = settings(data_dir, redis_url, tiny_model_dir, inference["url"])
    assert [extract(state, i, cfg, redis_conn) for i in (0, 1)] == ["done", "done"]
    one = load_file(state.paths.hidden(1))
    assert one["input_ids"].tolist() == prompt + reply
    assert one["loss_mask"].tolist() == [0] * len(prompt) + [1] * len(reply)
    cut = load_file(state.paths.hidden(0))
    assert cut["input_ids"].tolist() == (prompt + long_reply)[:40]
    assert cut["loss_mask"].tolist() == ([0] * len(prompt) + [1] * 50)[:40]


@pytest.mark.parametrize("token_ids, says", [
    ({"prompt": [1, 2], "reply": "17 18"}, "token_ids is not"),
    ({"prompt": [1, -2], "reply": [5]}, "token_ids is not"),
    ({"prompt": [1, 2]}, "token_ids is not"),
    ({"prompt": [1, 2], "reply": []}, "empty prompt or reply"),
])
def test_malformed_engine_token_ids_fail_that_sample_by_name(token_ids, says, inference, data_dir, redis_url, redis_conn,
                                                            tmp_path, tiny_model_dir):
    state = make_run(data_dir, redis_conn, tmp_path, f"bad-ids-{abs(hash(says)) % 1000}-{len(str(token_ids))}")
    engine_record(state, 1, token_ids)
    cfg = settings(data_dir, redis_url, tiny_model_dir, inference["url"])
    assert [extract(state, i, cfg, redis_conn) for i in (1, 2)] == ["failed", "done"]  # the other sample is untouched
    (failure,) = state.failures("extract")
    assert failure.error_class == "GeneratedFileError" and says in failure.message and failure.sample_id == 1
    assert not state.paths.hidden(1).exists()
