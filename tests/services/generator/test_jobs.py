"""The generate job against a real OpenAI-compatible HTTP server whose answers each test scripts."""

from __future__ import annotations

import json

import pytest

from services.controller.runs.submit import submit_run
from services.generator.jobs import run_generate
from shared.jobs import EXTRACT_FUNC, EXTRACT_QUEUE, ExtractJob, GenerateJob, PromptItem, extract_job_id
from runtime.queues import queue
from shared.runspec import EvalConfig, GenerationConfig, RunSpec
from runtime.runstate import RunState
from shared.settings import GeneratorSettings
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.support.queues import extract_batches
from tests.support.openai_server import OpenAIServer, Reply
from tests.support.processes import free_port

RUN = "gen"
FAST_RETRIES = (0.05, 0.05, 0.05)


@pytest.fixture()
def server():
    with OpenAIServer(model="stand-in") as srv:
        yield srv


def make_run(data_dir, conn, tmp_path, n: int, *, min_tokens: int = 3) -> list[PromptItem]:
    rows = [{"prompt": f"p{i}"} for i in range(n)] + [{"prompt": "held out"}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    generation = GenerationConfig(max_tokens=33, min_completion_tokens=min_tokens, temperature=0.7, top_p=0.9, seed=100)
    submit_run(data_dir, conn, RunSpec(dataset=str(dataset), name=RUN, model="target-model", generation=generation,
                                       evaluate=EvalConfig(holdout=1)))
    lines = RunState(conn, data_dir, RUN).paths.prompts.read_text().splitlines()
    return [PromptItem(**json.loads(line)) for line in lines]


def settings(data_dir, redis_url, server) -> GeneratorSettings:
    return GeneratorSettings(data=data_dir, redis_url=redis_url, inference_url=server.url, concurrency=3,
                             request_timeout_s=10)


def test_each_sample_ends_done_dropped_or_named_and_never_costs_the_others(data_dir, redis_url, redis_conn, tmp_path, server):
    items = make_run(data_dir, redis_conn, tmp_path, 7)
    server.script("p0", Reply("answer zero is here", reasoning="thinking about zero"))
    server.script("p1", Reply("answer one is here", reasoning="thinking about one", reasoning_field="reasoning"))
    server.script("p2", Reply("short", completion_tokens=2))
    server.script("p3", Reply(status=400, error="This model's maximum context length is 8 tokens"))
    server.script("p4", Reply(status=503, error="overloaded"))
    server.script("p5", Reply(status=500), Reply("answer after a retry"))
    server.script("p6", Reply(malformed=True))
    summary = run_generate(GenerateJob(run=RUN, items=items), settings(data_dir, redis_url, server), redis_conn,
                           retry_delays_s=FAST_RETRIES)
    assert summary == {"done": 3, "dropped": 1, "failed": 3}

    state = RunState(redis_conn, data_dir, RUN)
    counts = state.counts("generate")
    assert (counts.done, counts.failed, counts.dropped) == (3, 3, 1)
    failures = {f.sample_id: f for f in state.failures("generate")}
    assert (failures[2].error_class, failures[2].kind) == ("ReplyTooShort", "dropped")
    assert failures[3].error_class == "PromptTooLong" and "maximum context length is 8 tokens" in failures[3].message
    assert failures[4].error_class == "InferenceUnavailable" and "503" in failures[4].message and "overloaded" in failures[4].message
    assert failures[6].error_class == "MalformedCompletion"
    assert len(server.requests_for("p4")) == len(FAST_RETRIES) + 1  # retried, then named
    assert len(server.requests_for("p3")) == 1  # a 4xx is never retried

    zero = json.loads(state.paths.generated(0).read_text())
    assert zero["reply"] == {"content": "answer zero is here", "reasoning_content": "thinking about zero"}
    assert zero["messages"] == [{"role": "user", "content": "p0"}]
    assert (zero["sample_id"], zero["finish_reason"], zero["model"], zero["schema_version"]) == (0, "stop", "target-model", 1)
    assert zero["usage"]["completion_tokens"] == 7
    one = json.loads(state.paths.generated(1).read_text())
    assert one["reply"]["reasoning_content"] == "thinking about one"
    assert json.loads(state.paths.generated(5).read_text())["reply"]["content"] == "answer after a retry"
    for sample_id in (2, 3, 4, 6):
        assert not state.paths.generated(sample_id).exists()

    extract = queue(EXTRACT_QUEUE, redis_conn)
    assert extract_batches(redis_conn) == {extract_job_id(RUN, 0): [0, 1, 5]}  # the replies, in one extract job
    job = extract.fetch_job(extract_job_id(RUN, 0))
    assert job.func_name == EXTRACT_FUNC
    assert ExtractJob.model_validate(job.args[0]).sample_ids == [0, 1, 5]


def test_request_carries_the_runs_generation_settings_and_a_per_sample_seed(data_dir, redis_url, redis_conn, tmp_path, server):
    items = make_run(data_dir, redis_conn, tmp_path, 3)
    run_generate(GenerateJob(run=RUN, items=items), settings(data_dir, redis_url, server), redis_conn)
    sent = {r["messages"][-1]["content"]: r for r in server.requests}
    assert sent["p2"] == {"model": "target-model", "messages": [{"role": "user", "content": "p2"}], "max_tokens": 33,
                          "temperature": 0.7, "top_p": 0.9, "seed": 102, "return_token_ids": True}
    assert sent["p0"]["seed"] == 100


def test_a_sample_with_a_reply_file_is_not_asked_again_but_its_extraction_is_ensured(data_dir, redis_url, redis_conn,
                                                                                     tmp_path, server):
    items = make_run(data_dir, redis_conn, tmp_path, 2)
    cfg = settings(data_dir, redis_url, server)
    run_generate(GenerateJob(run=RUN, items=items), cfg, redis_conn)
    assert len(server.requests) == 2
    extract = queue(EXTRACT_QUEUE, redis_conn)
    extract.fetch_job(extract_job_id(RUN, 0)).delete()  # the extraction job was lost (say, Redis restarted) ...
    RunState(redis_conn, data_dir, RUN).mark_done("extract", 0)  # ... but sample 0 had already been extracted
    summary = run_generate(GenerateJob(run=RUN, items=items), cfg, redis_conn)
    assert summary == {"skipped": 2}
    assert len(server.requests) == 2
    assert extract_batches(redis_conn) == {extract_job_id(RUN, 1): [1]}
    assert RunState(redis_conn, data_dir, RUN).counts("generate").done == 2


def test_a_jobs_replies_are_queued_for_extraction_in_jobs_of_extract_batch_once(data_dir, redis_url, redis_conn,
                                                                               tmp_path, server):
    items = make_run(data_dir, redis_conn, tmp_path, 5)
    cfg = settings(data_dir, redis_url, server).model_copy(update={"extract_batch": 2})
    assert run_generate(GenerateJob(run=RUN, items=items), cfg, redis_conn) == {"done": 5}
    expected = {extract_job_id(RUN, 0): [0, 1], extract_job_id(RUN, 2): [2, 3], extract_job_id(RUN, 4): [4]}
    assert extract_batches(redis_conn) == expected
    run_generate(GenerateJob(run=RUN, items=items), cfg, redis_conn)  # the same job again (requeued, say)
    assert extract_batches(redis_conn) == expected  # every reply still waits in exactly one job


def test_unreachable_server_is_a_named_inference_unavailable_failure(data_dir, redis_url, redis_conn, tmp_path):
    items = make_run(data_dir, redis_conn, tmp_path, 2)
    cfg = GeneratorSettings(data=data_dir, redis_url=redis_url, inference_url=f"http://127.0.0.1:{free_port()}/v1",
                            concurrency=2, request_timeout_s=5)
    assert run_generate(GenerateJob(run=RUN, items=items), cfg, redis_conn, retry_delays_s=FAST_RETRIES) == {"failed": 2}
    failures = RunState(redis_conn, data_dir, RUN).failures("generate")
    assert [(f.sample_id, f.error_class) for f in failures] == [(0, "InferenceUnavailable"), (1, "InferenceUnavailable")]
    assert "ConnectError" in failures[0].message and "gave up after 4 attempts" in failures[0].message


def commands(conn, *names: str) -> dict[str, int]:
    stats = conn.info("commandstats")
    return {name: stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in names}


def test_a_jobs_saved_replies_are_marked_and_their_bytes_counted_once_for_the_whole_job(data_dir, redis_url, redis_conn,
                                                                                         tmp_path, server):
    items = make_run(data_dir, redis_conn, tmp_path, 6)
    before = commands(redis_conn, "hincrbyfloat", "hincrby")
    assert run_generate(GenerateJob(run=RUN, items=items), settings(data_dir, redis_url, server), redis_conn) == {"done": 6}
    after = commands(redis_conn, "hincrbyfloat", "hincrby")
    # One count of the bytes, one of the requests and one of the settled samples (its bucket and the stage's
    # total, in one pipeline) for six replies, not one of each per reply.
    assert {name: after[name] - before[name] for name in after} == {"hincrbyfloat": 2, "hincrby": 2}
    state = RunState(redis_conn, data_dir, RUN)
    assert state.counts("generate").done == 6 and state.throughput("generate").settled == 6
    saved = sum(state.paths.generated(item.sample_id).stat().st_size for item in items)
    assert float(state.meta()["generated_bytes"]) == saved
    assert float(state.meta()["generate_requests"]) == 6


def test_max_turns_regenerates_a_conversations_first_turns_only(data_dir, redis_url, redis_conn, tmp_path, server):
    three = [{"role": "user", "content": "t1"}, {"role": "assistant", "content": "x"},
             {"role": "user", "content": "t2"}, {"role": "assistant", "content": "y"},
             {"role": "user", "content": "t3"}]
    dataset = write_jsonl(tmp_path / "chat.jsonl", [{"messages": three}, {"prompt": "held out"}])
    submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name=RUN, model="target-model",
                                             generation=GenerationConfig(min_completion_tokens=1, max_turns=2),
                                             evaluate=EvalConfig(holdout=1)))
    state = RunState(redis_conn, data_dir, RUN)
    items = [PromptItem(**json.loads(line)) for line in state.paths.prompts.read_text().splitlines()]
    server.set_default(Reply("the target's answer"))
    summary = run_generate(GenerateJob(run=RUN, items=items[:1]), settings(data_dir, redis_url, server), redis_conn)
    assert summary == {"done": 1}
    record = json.loads(state.paths.generated(0).read_text())
    assert [turn["messages"][-1]["content"] for turn in record["turns"]] == ["t1", "t2"]  # t3 is left out
    assert server.requests_for("t3") == [] and len(server.requests_for("t2")) == 1
    assert int(state.meta()["generate_requests"]) == 2
