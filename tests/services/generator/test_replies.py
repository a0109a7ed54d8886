"""The generate job with ``generation.replies`` > 1, against a real OpenAI-compatible HTTP server whose answers
each test scripts: how each reply is asked, what its file records, how its failure is named."""

from __future__ import annotations

import json

import pytest

from services.controller.runs.submit import submit_run
from services.generator.jobs import run_generate
from shared.jobs import GenerateJob, PromptItem
from shared.runspec import EvalConfig, GenerationConfig, RunSpec
from runtime.runstate import RunState
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.services.generator.test_jobs import settings
from tests.support.openai_server import OpenAIServer, Reply
from tests.support.queues import extract_batches

RUN = "replies"
SAMPLED = {"reply_temperature": 0.7, "reply_top_p": 0.9}


@pytest.fixture()
def server():
    with OpenAIServer(model="stand-in") as srv:
        yield srv


def submitted(data_dir, conn, tmp_path, rows: list[dict], **generation) -> list[PromptItem]:
    dataset = write_jsonl(tmp_path / "d.jsonl", [*rows, {"prompt": "held out"}])
    config = GenerationConfig(max_tokens=33, min_completion_tokens=3, seed=100, **generation)
    submit_run(data_dir, conn, RunSpec(dataset=str(dataset), name=RUN, model="target-model", generation=config,
                                       evaluate=EvalConfig(holdout=1)))
    lines = RunState(conn, data_dir, RUN).paths.prompts.read_text().splitlines()
    return [PromptItem(**json.loads(line)) for line in lines]


def test_each_prompt_is_asked_greedily_once_and_sampled_with_each_samples_own_seed(data_dir, redis_url, redis_conn,
                                                                                  tmp_path, server):
    items = submitted(data_dir, redis_conn, tmp_path, [{"prompt": "p0"}, {"prompt": "p1"}], replies=3, **SAMPLED)
    assert [item.sample_id for item in items] == [0, 1, 2, 3, 4, 5]  # rows 0, 1; then each sampled block
    summary = run_generate(GenerateJob(run=RUN, items=items), settings(data_dir, redis_url, server), redis_conn)
    assert summary == {"done": 6}
    asked = {(r["messages"][-1]["content"], r["seed"]): (r["temperature"], r["top_p"]) for r in server.requests}
    assert asked == {("p0", 100): (0.0, 1.0), ("p0", 102): (0.7, 0.9), ("p0", 104): (0.7, 0.9),
                     ("p1", 101): (0.0, 1.0), ("p1", 103): (0.7, 0.9), ("p1", 105): (0.7, 0.9)}
    paths = RunState(redis_conn, data_dir, RUN).paths
    records = {i: json.loads(paths.generated(i).read_text()) for i in range(6)}
    assert "sampled" not in records[0] and "sampled" not in records[1]  # a row's own reply, as with one reply
    assert records[5]["sampled"] == {"row": 1, "reply": 2, "temperature": 0.7, "top_p": 0.9, "seed": 105}
    assert [records[i]["messages"] for i in (1, 3, 5)] == [[{"role": "user", "content": "p1"}]] * 3
    assert [records[i]["sample_id"] for i in range(6)] == list(range(6))
    assert sorted(i for batch in extract_batches(redis_conn).values() for i in batch) == list(range(6))


def test_a_sampled_replys_failure_names_its_row_and_reply(data_dir, redis_url, redis_conn, tmp_path, server):
    items = submitted(data_dir, redis_conn, tmp_path, [{"prompt": "p0"}, {"prompt": "p1"}], replies=3, **SAMPLED)
    server.script("p1", Reply("short", completion_tokens=2))
    summary = run_generate(GenerateJob(run=RUN, items=items), settings(data_dir, redis_url, server), redis_conn)
    assert summary == {"done": 3, "dropped": 3}
    failures = {f.sample_id: f for f in RunState(redis_conn, data_dir, RUN).failures("generate")}
    assert set(failures) == {1, 3, 5} and {f.error_class for f in failures.values()} == {"ReplyTooShort"}
    assert failures[1].message.startswith("reply has 2 tokens")  # the row's own reply: named as with one reply
    assert failures[3].message.startswith("row 1, sampled reply 1 of 2: reply has 2 tokens")
    assert failures[5].message.startswith("row 1, sampled reply 2 of 2: reply has 2 tokens")


def test_a_sampled_conversation_samples_every_turn_after_its_own_earlier_replies(data_dir, redis_url, redis_conn,
                                                                                 tmp_path, server):
    chat = [{"role": "user", "content": "t1"}, {"role": "assistant", "content": "the dataset's answer"},
            {"role": "user", "content": "t2"}]
    items = submitted(data_dir, redis_conn, tmp_path, [{"messages": chat}], replies=2, **SAMPLED)
    assert [item.sample_id for item in items] == [0, 1]
    # The two first turns get different answers, in whichever order the two samples ask.
    server.script("t1", Reply("one answer to the first turn"), Reply("another answer to the first turn"))
    server.set_default(Reply("an answer to the second turn"))
    assert run_generate(GenerateJob(run=RUN, items=items), settings(data_dir, redis_url, server), redis_conn) == {"done": 2}
    paths = RunState(redis_conn, data_dir, RUN).paths
    for sample_id, temperature in ((0, 0.0), (1, 0.7)):
        record = json.loads(paths.generated(sample_id).read_text())
        first = record["turns"][0]["reply"]["content"]
        second = next(r for r in server.requests_for("t2") if r["seed"] == 100 + sample_id)
        assert second["temperature"] == temperature and second["messages"][1] == {"role": "assistant", "content": first}
        assert next(r for r in server.requests_for("t1") if r["seed"] == 100 + sample_id)["temperature"] == temperature
        assert record["messages"] == second["messages"]
    firsts = {json.loads(paths.generated(i).read_text())["turns"][0]["reply"]["content"] for i in (0, 1)}
    assert len(firsts) == 2  # each conversation went on from its own first reply
