"""Submitting a run of several replies per prompt (``generation.replies``): the sample ids, the prompt lines, the
held-out rows, the named bad rows and the counts, against a run of one reply of the same rows (real Redis)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime import disk
from runtime.runstate import RunState
from services.controller.loop.reconcile import reconcile_run
from services.controller.runs import preflight as pf
from services.controller.runs.submit import submit_run
from shared.layout import RunPaths
from shared.runspec import EvalConfig, GenerationConfig, RunSpec
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.services.controller.runs.test_preflight import TINY_CARD, settings_for, spec_for


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def dataset_with_bad_rows(tmp_path: Path) -> Path:
    rows: list = [{"prompt": f"question {i}"} for i in range(12)]
    rows[3], rows[7] = "{broken", {"messages": []}
    return write_jsonl(tmp_path / "d.jsonl", rows)


def submit(data_dir, conn, dataset: Path, name: str, replies: int, holdout: int = 3) -> RunSpec:
    generation = GenerationConfig(replies=replies, reply_temperature=0.8)
    return submit_run(data_dir, conn, RunSpec(dataset=str(dataset), name=name, model="tiny", generation=generation,
                                              evaluate=EvalConfig(holdout=holdout)))


def test_three_replies_give_each_training_prompt_three_ids_and_leave_the_held_out_rows_as_they_were(
        data_dir, redis_conn, tmp_path):
    dataset = dataset_with_bad_rows(tmp_path)
    one, three = submit(data_dir, redis_conn, dataset, "one", 1), submit(data_dir, redis_conn, dataset, "three", 3)
    first, paths = RunPaths(data_dir, "one"), RunPaths(data_dir, "three")
    # Rows 0..8 precede the first held-out row (9); the bad rows 3 and 7 have no prompt line.
    assert (one.rows, one.train_ids, one.prompt_rows) == (12, 9, 9)
    assert (three.rows, three.train_ids, three.prompt_rows) == (12 + 2 * 9, 27, 9)
    trained = [0, 1, 2, 4, 5, 6, 8]
    assert [r["sample_id"] for r in read_lines(first.prompts)] == trained
    assert [r["sample_id"] for r in read_lines(paths.prompts)] == trained + [i + 9 for i in trained] + [i + 18 for i in trained]
    # The rows' own lines are the one-reply run's, byte for byte; each sampled line repeats its row's messages.
    assert paths.prompts.read_bytes().startswith(first.prompts.read_bytes())
    messages = {r["sample_id"]: r["messages"] for r in read_lines(paths.prompts)}
    assert all(messages[i + 9] == messages[i + 18] == messages[i] for i in trained)
    # The same rows held out, with no sampled reply: their ids move up past the sampled ones.
    held_one, held_three = read_lines(first.eval_prompts), read_lines(paths.eval_prompts)
    assert [r["sample_id"] for r in held_one] == [9, 10, 11] and [r["sample_id"] for r in held_three] == [27, 28, 29]
    assert [r["messages"] for r in held_three] == [r["messages"] for r in held_one]
    assert [three.reply_of(r["sample_id"]) for r in held_three] == [(9, 0), (10, 0), (11, 0)]
    assert RunSpec.load(data_dir, "three") == three


def test_a_bad_row_fails_each_of_its_ids_and_the_counts_hold_every_sample(data_dir, redis_conn, tmp_path):
    dataset = dataset_with_bad_rows(tmp_path)
    submit(data_dir, redis_conn, dataset, "one", 1)
    submit(data_dir, redis_conn, dataset, "three", 3)
    one, three = RunState(redis_conn, data_dir, "one"), RunState(redis_conn, data_dir, "three")
    assert {f.sample_id for f in one.failures()} == {3, 7}
    failures = {f.sample_id: f for f in three.failures()}
    assert set(failures) == {3, 12, 21, 7, 16, 25}
    assert {failures[i].error_class for i in (3, 12, 21)} == {"InvalidJson"}
    assert failures[7].message == "messages is an empty list"  # the row's own id: named as with one reply
    assert failures[16].message == "row 7, sampled reply 1 of 2: messages is an empty list"
    assert failures[25].message == "row 7, sampled reply 2 of 2: messages is an empty list"
    assert (one.expected(), three.expected()) == (9, 27)  # every sample id less the 3 held-out rows
    assert (one.counts("generate").failed, three.counts("generate").failed) == (2, 6)
    meta = three.meta()
    assert (meta["train_ids"], meta["holdout"]) == ("27", "3")
    assert int(meta["prompts_bytes"]) == three.paths.prompts.stat().st_size


def test_a_bad_row_after_the_first_held_out_one_keeps_one_id_above_the_sampled_ones(data_dir, redis_conn, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", [*({"prompt": f"q{i}"} for i in range(4)), "{bad", {"prompt": "last"}])
    spec = submit(data_dir, redis_conn, dataset, "late", 2, holdout=2)
    # Rows 0..2 train (ids 0..2 and 3..5); row 3 is held out (6), the bad row 4 is 7, the held-out row 5 is 8.
    assert (spec.rows, spec.train_ids) == (9, 6)
    assert [r["sample_id"] for r in read_lines(RunPaths(data_dir, "late").eval_prompts)] == [6, 8]
    state = RunState(redis_conn, data_dir, "late")
    assert [f.sample_id for f in state.failures()] == [7] and state.expected() == 7


def test_the_disk_projection_counts_every_reply(data_dir, redis_conn, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a question of some length " * 4} for _ in range(10)])
    projected = {}
    for replies in (1, 3):
        name = f"r{replies}"
        submit(data_dir, redis_conn, dataset, name, replies, holdout=2)
        state = RunState(redis_conn, data_dir, name)
        headroom = disk.assess(state, bytes_per_token_hint=100.0)
        assert headroom.remaining_samples == 8 * replies
        projected[replies] = headroom
    # Each sample's reply and hidden states are estimated alike: three replies, three times the bytes (within the
    # digits the sampled ids add to their prompt lines).
    assert projected[3].hidden_bytes == pytest.approx(3 * projected[1].hidden_bytes, rel=0.01)
    assert projected[3].replies_bytes == pytest.approx(3 * projected[1].replies_bytes, rel=0.01)
    assert projected[1].hidden_bytes > 0 and projected[1].replies_bytes > 0
    one = pf.check_disk(settings_for(tmp_path), spec_for(dataset), pf.Facts(card=TINY_CARD))
    three = pf.check_disk(settings_for(tmp_path), spec_for(dataset, generation=GenerationConfig(max_tokens=32, replies=3)),
                          pf.Facts(card=TINY_CARD))
    assert "8 samples ×" in one.message and "24 samples (3 replies per prompt) ×" in three.message


def test_a_run_of_three_replies_is_rebuilt_from_the_volume_with_every_sample(data_dir, redis_conn, tmp_path):
    submit(data_dir, redis_conn, dataset_with_bad_rows(tmp_path), "three", 3)
    state = RunState(redis_conn, data_dir, "three")
    # Row 1's first sampled reply (id 10), as its generator left it; then Redis loses the run.
    reply = {"sample_id": 10, "messages": [{"role": "user", "content": "question 1"}], "reply": {"content": "x"}}
    state.paths.generated(10).parent.mkdir(parents=True)
    state.paths.generated(10).write_text(json.dumps(reply))
    state.delete()
    report = reconcile_run(data_dir, redis_conn, "three")
    assert (report.expected, report.generated, report.named, report.failures_kept) == (27, 1, [], 6)
    assert state.expected() == 27 and state.is_done("generate", 10) and state.meta()["train_ids"] == "27"


def test_an_online_runs_plan_reads_every_reply_of_every_prompt(data_dir, redis_conn, tmp_path):
    from services.trainer.online_plan import with_replies

    spec = submit(data_dir, redis_conn, dataset_with_bad_rows(tmp_path), "three", 3)
    paths = RunPaths(data_dir, "three")
    ids = [r["sample_id"] for r in read_lines(paths.prompts)]
    for sample_id in ids:  # every sample's reply on the volume, as generation leaves it
        paths.generated(sample_id).parent.mkdir(parents=True, exist_ok=True)
        paths.generated(sample_id).write_text("{}")
    assert [i for i, _ in with_replies(paths, spec)] == sorted(ids) and len(ids) == 3 * 7
