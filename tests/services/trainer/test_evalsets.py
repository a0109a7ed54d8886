"""Evaluation sets: HumanEval's prompts from the installed package, left out where training repeats them."""

from __future__ import annotations

import json

from services.trainer.evalsets import HUMANEVAL_SIZE, humaneval_prompts, load_sets, read_humaneval
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
