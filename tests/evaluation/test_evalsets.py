"""Evaluation sets: HumanEval's prompts from the installed package, left out where training repeats them."""

from __future__ import annotations

import json

import pytest

from evaluation.evalsets import HUMANEVAL_SIZE, humaneval_prompts, load_sets, read_humaneval
from shared.errors import DatasetError
from shared.runspec import EvalConfig


def test_humaneval_loads_its_164_prompts_each_asked_as_a_user_message():
    prompts, excluded = humaneval_prompts(None)
    assert len(prompts) == HUMANEVAL_SIZE == 164 and excluded == []
    assert [p.sample_id for p in prompts] == list(range(164))
    tasks = read_humaneval()
    for prompt, task in zip(prompts, tasks):
        (message,) = prompt.messages
        assert message["role"] == "user"
        assert message["content"] == f"Complete this Python function:\n```python\n{task.prompt}```"
    assert "def has_close_elements(" in prompts[0].messages[0]["content"]
    assert len(humaneval_prompts(3)[0]) == 3


def test_a_humaneval_task_a_training_prompt_repeats_is_left_out_and_named(tmp_path):
    train = tmp_path / "prompts.jsonl"
    signature = "def has_close_elements(numbers: List[float], threshold: float) -> bool:"
    rows = [{"sample_id": 0, "messages": [{"role": "user", "content": f"Fix this:\n    {signature}\n    pass"}]},
            {"sample_id": 1, "messages": [{"role": "user", "content": "def unrelated(): pass"}]}]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts, excluded = humaneval_prompts(5, train_prompts=train)
    assert excluded == [0] and [p.sample_id for p in prompts] == [1, 2, 3, 4]


def test_sets_follow_the_config_and_holdout_needs_held_out_rows(tmp_path):
    held = tmp_path / "eval_prompts.jsonl"
    held.write_text(json.dumps({"sample_id": 9, "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    missing = tmp_path / "prompts.jsonl"  # no training prompts on the volume: nothing to overlap
    sets = load_sets(EvalConfig(holdout=1, humaneval_limit=2), eval_prompts=held, train_prompts=missing)
    assert [(s.name, [p.sample_id for p in s.prompts]) for s in sets] == [("holdout", [9]), ("humaneval", [0, 1])]
    sets = load_sets(EvalConfig(holdout=0, sets=["humaneval", "holdout"], humaneval_limit=1), eval_prompts=held,
                     train_prompts=missing)
    assert [s.name for s in sets] == ["humaneval"]
    assert load_sets(EvalConfig(holdout=0, sets=["holdout"]), eval_prompts=held, train_prompts=missing) == []


def conversation(*turns: str) -> list[dict]:
    """User turns with the dataset's (another model's) reply after each but the last."""
    messages = []
    for number, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        if number < len(turns) - 1:
            messages.append({"role": "assistant", "content": f"dataset reply {number}"})
    return messages


def test_regenerated_runs_ask_the_first_turn_and_the_second_after_the_targets_own_reply(tmp_path):
    held = tmp_path / "eval_prompts.jsonl"
    rows = [{"sample_id": 7, "messages": conversation("first", "second", "third")},
            {"sample_id": 8, "messages": conversation("only")}]
    held.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = EvalConfig(holdout=2, sets=["holdout", "holdout_turn2"])
    first, second = load_sets(cfg, eval_prompts=held, train_prompts=tmp_path / "none", turns="all")
    assert [(p.sample_id, p.messages, p.earlier) for p in first.prompts] == [
        (7, [{"role": "user", "content": "first"}], ()), (8, [{"role": "user", "content": "only"}], ())]
    # The dataset's replies are gone: the target answers the first turn itself before the second is asked.
    (turn2,) = second.prompts
    assert (turn2.sample_id, turn2.messages, turn2.earlier) == (
        7, [{"role": "user", "content": "second"}], (({"role": "user", "content": "first"},),))
    # A run that keeps the dataset's replies asks the conversation as it is, and has no second-turn set.
    (kept,) = load_sets(EvalConfig(holdout=2, sets=["holdout"]), eval_prompts=held, train_prompts=tmp_path / "none",
                        turns="last")
    assert kept.prompts[0].messages == rows[0]["messages"]
    # Held-out conversations of one turn each have no second turn: the set is left out, not reported as 0.
    single = tmp_path / "single.jsonl"
    single.write_text(json.dumps(rows[1]) + "\n")
    assert [s.name for s in load_sets(cfg, eval_prompts=single, train_prompts=tmp_path / "none", turns="all")] == [
        "holdout"]
    with pytest.raises(DatasetError, match="holdout_turn2 needs generation.turns"):
        load_sets(cfg, eval_prompts=held, train_prompts=tmp_path / "none", turns="last")


def test_held_out_prompts_holding_characters_splitlines_breaks_at_are_read_whole(tmp_path):
    from evaluation.evalsets import read_eval_prompts
    from services.controller.runs.submit import prompt_line

    tricky = ["a line\u2028separator", "a paragraph\u2029separator", "form\x0cfeed", "next\x85line", "group\x1dsep"]
    held = tmp_path / "eval_prompts.jsonl"
    held.write_bytes(b"".join(prompt_line(i, [{"role": "user", "content": text}]) for i, text in enumerate(tricky)))
    prompts = read_eval_prompts(held)
    assert [p.messages[0]["content"] for p in prompts] == tricky  # as the controller wrote them, one per line
