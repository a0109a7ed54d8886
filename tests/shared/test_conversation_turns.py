"""Which assistant turns the target writes: a conversation split into turns (shared/DATA.md's ShareGPT cases),
and the generate job asking turn by turn against a real OpenAI-compatible server whose answers are scripted."""

from __future__ import annotations

import json

import pytest

from services.controller.runs.submit import submit_run
from services.generator.jobs import run_generate
from shared.conversation_turns import turn_segments
from shared.jobs import GenerateJob, PromptItem
from shared.runspec import EvalConfig, GenerationConfig, RunSpec
from runtime.runstate import RunState
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.services.generator.test_jobs import FAST_RETRIES, settings
from tests.support.openai_server import OpenAIServer, Reply

RUN = "turns"
SYSTEM = {"role": "system", "content": "Be brief."}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize(("messages", "segments"), [
    ([user("u1")], [[user("u1")]]),
    ([SYSTEM, user("u1"), assistant("a1"), user("u2")], [[SYSTEM, user("u1")], [user("u2")]]),
    # ShareGPT's split can start a part with the assistant: it answers nothing here, so it goes.
    ([assistant("a0"), user("u1"), assistant("a1"), user("u2")], [[user("u1")], [user("u2")]]),
    ([SYSTEM, assistant("a0"), user("u1")], [[SYSTEM, user("u1")]]),
    # Two user turns with no reply between: answered together, once.
    ([user("u1"), user("u1b"), assistant("a1"), user("u2")], [[user("u1"), user("u1b")], [user("u2")]]),
    # Two assistant turns in a row mark one reply.
    ([user("u1"), assistant("a1"), assistant("a1b"), user("u2")], [[user("u1")], [user("u2")]]),
], ids=["single", "system", "leading-assistant", "leading-assistant-after-system", "two-user-turns",
        "two-assistant-turns"])
def test_a_conversation_splits_into_the_turns_the_target_answers(messages, segments):
    assert turn_segments(messages, "all") == segments


def test_last_keeps_the_conversation_as_the_dataset_wrote_it():
    messages = [user("u1"), assistant("a1"), user("u2")]
    assert turn_segments(messages, "last") == [messages]


@pytest.fixture()
def server():
    with OpenAIServer(model="stand-in") as srv:
        yield srv


def make_run(data_dir, conn, tmp_path, rows: list[dict], turns: str) -> list[PromptItem]:
    dataset = write_jsonl(tmp_path / "chat.jsonl", [*rows, {"prompt": "held out"}])
    generation = GenerationConfig(max_tokens=20, min_completion_tokens=3, turns=turns)
    submit_run(data_dir, conn, RunSpec(dataset=str(dataset), name=RUN, model="target-model", generation=generation,
                                       evaluate=EvalConfig(holdout=1)))
    lines = RunState(conn, data_dir, RUN).paths.prompts.read_text().splitlines()
    return [PromptItem(**json.loads(line)) for line in lines]


CHAT = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "first question"},
                          {"from": "gpt", "value": "another model's first answer"},
                          {"from": "human", "value": "second question"},
                          {"from": "gpt", "value": "another model's second answer"}]}


def test_every_turn_is_the_targets_own_answer_to_the_conversation_so_far(data_dir, redis_url, redis_conn, tmp_path,
                                                                         server):
    items = make_run(data_dir, redis_conn, tmp_path, [CHAT], "all")
    server.script("first question", Reply("the target's first answer", reasoning="thought one"))
    server.script("second question", Reply("the target's second answer"))
    summary = run_generate(GenerateJob(run=RUN, items=items), settings(data_dir, redis_url, server), redis_conn)
    assert summary == {"done": 1}
    first, second = (request["messages"] for request in server.requests)
    assert first == [SYSTEM, user("first question")]
    assert second == [SYSTEM, user("first question"),
                      {"role": "assistant", "content": "the target's first answer", "reasoning": "thought one",
                       "reasoning_content": "thought one"},
                      user("second question")]
    state = RunState(redis_conn, data_dir, RUN)
    record = json.loads(state.paths.generated(0).read_text())
    # The top level is the last turn (what a single-turn reader takes); every turn is kept in order.
    assert record["messages"] == second and record["reply"]["content"] == "the target's second answer"
    assert [turn["messages"] for turn in record["turns"]] == [first, second]
    assert [turn["reply"]["content"] for turn in record["turns"]] == ["the target's first answer",
                                                                      "the target's second answer"]
    assert "another model" not in json.dumps(record)
    assert float(state.meta()["generate_requests"]) == 2


def test_last_answers_only_the_last_turn_after_the_datasets_own(data_dir, redis_url, redis_conn, tmp_path, server):
    items = make_run(data_dir, redis_conn, tmp_path, [CHAT], "last")
    server.script("second question", Reply("the target's second answer"))
    summary = run_generate(GenerateJob(run=RUN, items=items), settings(data_dir, redis_url, server), redis_conn)
    assert summary == {"done": 1}
    (request,) = server.requests
    assert request["messages"][2] == assistant("another model's first answer")
    record = json.loads(RunState(redis_conn, data_dir, RUN).paths.generated(0).read_text())
    assert "turns" not in record


def test_a_failing_or_short_turn_names_the_sample_and_its_turn(data_dir, redis_url, redis_conn, tmp_path, server):
    rows = [{"messages": [user(f"q{i}"), assistant("x"), user(f"follow-up {i}")]} for i in range(2)]
    items = make_run(data_dir, redis_conn, tmp_path, rows, "all")
    server.script("q0", Reply("a fine first answer"))
    server.script("follow-up 0", Reply(status=400, error="too long for the context"))
    server.script("q1", Reply("no", completion_tokens=1))
    summary = run_generate(GenerateJob(run=RUN, items=items), settings(data_dir, redis_url, server), redis_conn,
                           retry_delays_s=FAST_RETRIES)
    assert summary == {"failed": 1, "dropped": 1}
    state = RunState(redis_conn, data_dir, RUN)
    failures = {f.sample_id: f for f in state.failures("generate")}
    assert failures[0].error_class == "InferenceRejected" and failures[0].message.startswith("turn 2 of 2: HTTP 400")
    assert failures[1].error_class == "ReplyTooShort" and failures[1].kind == "dropped"
    assert failures[1].message.startswith("turn 1 of 2: reply has 1 tokens")
    assert not server.requests_for("follow-up 1")  # a dropped turn ends its conversation
    assert float(state.meta()["generate_requests"]) == 3
