"""Replies keep the engine's own token ids: the real built-in server answers ``return_token_ids`` as vLLM does."""

from __future__ import annotations

import json

import pytest

from services.controller.runs.submit import submit_run
from services.generator.client import MalformedCompletion, parse_completion
from services.generator.jobs import run_generate
from shared.jobs import GenerateJob, PromptItem
from shared.runspec import EvalConfig, GenerationConfig, RunSpec
from runtime.runstate import RunState
from shared.settings import GeneratorSettings
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.support.processes import ServiceProcess, free_port


@pytest.fixture(scope="module")
def inference(tiny_model_dir, tmp_path_factory):
    port = free_port()
    env = {"DRAFTLINE_MODEL_DIR": str(tiny_model_dir), "DRAFTLINE_DATA": str(tmp_path_factory.mktemp("vol")),
           "DRAFTLINE_PORT": str(port), "DRAFTLINE_HOST": "127.0.0.1", "DRAFTLINE_DEVICE": "cpu"}
    with ServiceProcess("inference", env=env, log_dir=tmp_path_factory.mktemp("logs"),
                        health_url=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


def generate(inference: str, data_dir, redis_url, redis_conn, tmp_path, run: str, rows: list[dict], *,
             max_tokens: int) -> tuple[RunState, list[PromptItem]]:
    """Submit ``rows`` (and one held out) as a greedy run and generate every sample through the real server."""
    dataset = write_jsonl(tmp_path / f"{run}.jsonl", [*rows, {"prompt": "held out"}])
    generation = GenerationConfig(max_tokens=max_tokens, min_completion_tokens=1, temperature=0.0)
    submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name=run, model="tiny", generation=generation,
                                             evaluate=EvalConfig(holdout=1)))
    state = RunState(redis_conn, data_dir, run)
    items = [PromptItem(**json.loads(line)) for line in state.paths.prompts.read_text().splitlines()]
    cfg = GeneratorSettings(data=data_dir, redis_url=redis_url, inference_url=inference, concurrency=2,
                            request_timeout_s=60)
    assert run_generate(GenerateJob(run=run, items=items), cfg, redis_conn) == {"done": len(rows)}
    return state, items


def test_a_reply_record_holds_the_prompt_and_reply_ids_the_engine_ran(inference, data_dir, redis_url, redis_conn,
                                                                      tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    prompts = ["What is 2 + 2?", "Name three primes."]
    state, items = generate(inference, data_dir, redis_url, redis_conn, tmp_path, "ids",
                            [{"prompt": p} for p in prompts], max_tokens=12)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for item in items:
        record = json.loads(state.paths.generated(item.sample_id).read_text())
        ids = record["token_ids"]
        assert ids["prompt"] == list(tokenizer.apply_chat_template(item.messages, add_generation_prompt=True,
                                                                   tokenize=True, return_dict=True)["input_ids"])
        assert len(ids["reply"]) == record["usage"]["completion_tokens"] >= 1
        assert tokenizer.decode(ids["reply"], skip_special_tokens=True).strip() == record["reply"]["content"].strip()


def test_token_ids_that_are_not_ids_make_the_answer_malformed_and_absent_ones_are_none():
    body = {"model": "m", "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}
    assert parse_completion(body).token_ids is None and parse_completion(body).prompt_token_ids is None
    ok = parse_completion({**body, "prompt_token_ids": [1, 2],
                           "choices": [{**body["choices"][0], "token_ids": [5, 6]}]})
    assert (ok.prompt_token_ids, ok.token_ids) == ([1, 2], [5, 6])
    for bad in ({"prompt_token_ids": [1, "2"]}, {"prompt_token_ids": [True]}, {"prompt_token_ids": 3}):
        with pytest.raises(MalformedCompletion, match="prompt_token_ids is not a list of token ids"):
            parse_completion({**body, **bad})


def test_a_conversation_regenerated_turn_by_turn_is_learned_in_every_turn(inference, data_dir, redis_url, redis_conn,
                                                                          tmp_path, tiny_model_dir):
    """Two turns through the real server: the second turn's prompt ids, as the server rendered them, hold the
    first turn's prompt and reply ids exactly, so the extractor learns both replies from the engine's ids."""
    from transformers import AutoTokenizer

    from shared.sample_tokens import sample_of
    from shared.chat_turns import find_turn_end

    row = {"messages": [{"role": "user", "content": "Write three short bullet points about a binary search."},
                        {"role": "assistant", "content": "another model's answer"},
                        {"role": "user", "content": "Explain a binary search to a ten-year-old."}]}
    state, _ = generate(inference, data_dir, redis_url, redis_conn, tmp_path, "chat", [row], max_tokens=48)
    record = json.loads(state.paths.generated(0).read_text())
    first, second = record["turns"]
    assert second["messages"][1]["content"] == first["reply"]["content"] != "another model's answer"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids, mask, unlearned = sample_of(record, tokenizer, find_turn_end(tokenizer), 4096, state.paths.generated(0))
    assert unlearned == []
    assert ids == second["token_ids"]["prompt"] + second["token_ids"]["reply"]
    spans = [(len(turn["token_ids"]["prompt"]), len(turn["token_ids"]["prompt"]) + len(turn["token_ids"]["reply"]))
             for turn in (first, second)]
    assert [i for i, bit in enumerate(mask) if bit] == [i for start, end in spans for i in range(start, end)]
