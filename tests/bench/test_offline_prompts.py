"""The benchmark's offline training prompts: code-completion tasks asked as HumanEval is asked, none of them
HumanEval's own."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from services.trainer.evalsets import HUMANEVAL_WORDING, read_humaneval

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


def test_the_pool_mixes_completion_tasks_into_the_sampled_prompts():
    rows = offline_prompts.prompts(2000)
    completions = sum(row["prompt"].startswith("Complete this Python function:") for row in rows)
    assert 0 < completions < len(rows) and len({row["prompt"] for row in rows}) == len(rows)
