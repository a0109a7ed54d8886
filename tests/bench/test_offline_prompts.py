"""The benchmark's offline training prompts: code-completion tasks asked as HumanEval is asked, none of them
HumanEval's own."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from evaluation.evalsets import HUMANEVAL_WORDING, read_humaneval

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import offline_prompts  # noqa: E402


def test_completion_tasks_are_stdlib_signatures_asked_in_humanevals_wording_and_share_no_def_line_with_it():
    tasks = list(offline_prompts.completion_tasks())
    assert len(tasks) >= 300
    assert offline_prompts.COMPLETION_WORDING.replace("{code}", "{prompt}") == HUMANEVAL_WORDING
    humaneval_defs = {sig for task in read_humaneval() for sig in task.signatures()}
    for task in tasks:
        code = re.fullmatch(r"Complete this Python function:\n```python\n(.*)```", task, re.S).group(1)
        (function,) = ast.parse(code + "    pass\n").body  # a signature and docstring, the body left to write
        assert isinstance(function, ast.FunctionDef) and ast.get_docstring(function)
        assert code.splitlines()[0].strip() not in humaneval_defs
    assert len(set(tasks)) == len(tasks)


def test_every_completion_task_is_taken_first_and_mixed_in():
    tasks = set(offline_prompts.completion_tasks())
    rows = [row["prompt"] for row in offline_prompts.prompts(2000)]
    assert len(set(rows)) == len(rows) == 2000
    assert tasks <= set(rows)  # all of them, though they are under a twentieth of the pool
    positions = [i for i, prompt in enumerate(rows) if prompt in tasks]
    assert positions[0] < 200 and positions[-1] > 1800  # shuffled among the prose prompts, not a block
    fewer = [row["prompt"] for row in offline_prompts.prompts(100)]
    assert set(fewer) <= tasks and len(fewer) == 100  # fewer rows than tasks: tasks only
    assert offline_prompts.prompts(2000) == offline_prompts.prompts(2000)  # deterministic
