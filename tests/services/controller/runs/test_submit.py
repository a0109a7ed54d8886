"""Submitting a run: prompt files, held-out rows, named bad rows, the registered run, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.controller.runs.submit import default_run_name, submit_run
from shared.errors import DatasetError, RunExists
from shared.layout import RunPaths, check_run_name
from shared.runspec import EvalConfig, GenerationConfig, RunSpec
from runtime.runstate import RunState, known_runs
from tests.services.controller.runs.test_datasets import write_jsonl


def prompts(n: int) -> list[dict]:
    return [{"prompt": f"question {i}"} for i in range(n)]


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_submit_writes_prompts_holdout_spec_and_state(data_dir, redis_conn, tmp_path):
    rows = prompts(12)
    rows[3] = "{broken"
    rows[7] = {"messages": []}
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    spec = submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name="r1", model="tiny",
                                                    generation=GenerationConfig(max_tokens=9),
                                                    evaluate=EvalConfig(holdout=3)))
    paths = RunPaths(data_dir, "r1")
    # Held out: the last 3 valid rows (9, 10, 11); the bad rows 3 and 7 are failures, not prompts.
    assert [r["sample_id"] for r in read_lines(paths.prompts)] == [0, 1, 2, 4, 5, 6, 8]
    assert read_lines(paths.prompts)[0] == {"sample_id": 0, "messages": [{"role": "user", "content": "question 0"}]}
    assert [r["sample_id"] for r in read_lines(paths.eval_prompts)] == [9, 10, 11]
    assert read_lines(paths.eval_prompts)[0]["messages"] == [{"role": "user", "content": "question 9"}]
    assert (spec.rows, spec.train_ids, spec.model, spec.generation.max_tokens) == (12, 9, "tiny", 9)
    assert RunSpec.load(data_dir, "r1") == spec
    state = RunState(redis_conn, data_dir, "r1")
    meta = state.meta()
    assert state.expected() == 9  # 12 rows read - 3 held out; the 2 bad rows included
    assert meta["state"] == "generating"
    assert meta["feed_offset"] == "0"
    assert int(meta["prompts_bytes"]) == paths.prompts.stat().st_size
    assert "r1" in known_runs(redis_conn)


def test_each_bad_row_is_a_named_generate_failure_on_volume_and_in_redis(data_dir, redis_conn, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", [*prompts(3), "{broken", {"prompt": 42}, *prompts(2)])
    submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name="r2", model="m",
                                             evaluate=EvalConfig(holdout=1)))
    state = RunState(redis_conn, data_dir, "r2")
    failures = {f.sample_id: f for f in state.failures()}
    assert set(failures) == {3, 4}
    assert (failures[3].stage, failures[3].error_class, failures[3].kind) == ("generate", "InvalidJson", "error")
    assert failures[4].error_class == "WrongType" and failures[4].message == "prompt is an int, expected a string"
    on_disk = json.loads(state.paths.failure("generate", 4).read_text())
    assert on_disk["error_class"] == "WrongType"
    assert state.counts("generate").failed == 2


def test_bad_rows_after_the_holdout_start_still_count_as_expected(data_dir, redis_conn, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", [*prompts(4), "{bad", {"prompt": "last"}])
    spec = submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name="r3", model="m",
                                                    evaluate=EvalConfig(holdout=2)))
    # Valid ids 0..3 and 5; held out 3 and 5; bad id 4 sits between them and is still expected (as a failure).
    assert spec.train_ids == 3
    assert RunState(redis_conn, data_dir, "r3").expected() == 4
    assert [r["sample_id"] for r in read_lines(RunPaths(data_dir, "r3").eval_prompts)] == [3, 5]


def test_limit_reads_only_the_first_rows(data_dir, redis_conn, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts(50))
    spec = submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name="r4", model="m", limit=10,
                                                    evaluate=EvalConfig(holdout=2)))
    assert (spec.rows, spec.train_ids, spec.limit) == (10, 8, 10)
    assert len(read_lines(RunPaths(data_dir, "r4").prompts)) == 8


def test_existing_run_is_refused_and_left_untouched(data_dir, redis_conn, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts(5))
    first = submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name="same", model="m",
                                                     evaluate=EvalConfig(holdout=1)))
    before = RunPaths(data_dir, "same").prompts.read_bytes()
    other = write_jsonl(tmp_path / "other.jsonl", prompts(9))
    with pytest.raises(RunExists, match="already exists"):
        submit_run(data_dir, redis_conn, RunSpec(dataset=str(other), name="same", model="m"))
    assert RunSpec.load(data_dir, "same") == first
    assert RunPaths(data_dir, "same").prompts.read_bytes() == before
    assert RunState(redis_conn, data_dir, "same").expected() == 4


def test_dataset_without_valid_rows_is_refused_and_leaves_nothing(data_dir, redis_conn, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["{bad", {"prompt": ""}])
    with pytest.raises(DatasetError, match="no valid rows among 2 read; first problem: row 0: InvalidJson"):
        submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name="empty", model="m"))
    assert not RunPaths(data_dir, "empty").root.exists()
    assert known_runs(redis_conn) == []
    assert list(redis_conn.scan_iter("draftline:run:empty:*")) == []


def test_holdout_that_leaves_nothing_to_train_is_refused(data_dir, redis_conn, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts(3))
    with pytest.raises(DatasetError, match="leaves none to train on"):
        submit_run(data_dir, redis_conn, RunSpec(dataset=str(dataset), name="tiny", model="m",
                                                 evaluate=EvalConfig(holdout=3)))
    assert not RunPaths(data_dir, "tiny").root.exists()


def test_missing_dataset_is_refused(data_dir, redis_conn, tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        submit_run(data_dir, redis_conn, RunSpec(dataset=str(tmp_path / "nope.jsonl"), name="x", model="m"))
    assert known_runs(redis_conn) == []


def test_default_name_is_a_valid_run_name(data_dir, redis_conn, tmp_path):
    assert check_run_name(default_run_name("owner/My Dataset!")).startswith("My-Dataset-")
    dataset = write_jsonl(tmp_path / "chat prompts.jsonl", prompts(4))
    spec = submit_run(data_dir, redis_conn, RunSpec(name=default_run_name(str(dataset)), dataset=str(dataset),
                                                    model="m", evaluate=EvalConfig(holdout=1)))
    assert spec.name.startswith("chat-prompts-")
    assert RunSpec.load(data_dir, spec.name).name == spec.name
