"""Training prompts from what every machine has: the Python standard library's own documentation.

The GPU benchmark needs thousands of prompts with no network and none of them an evaluation prompt.
Each public function and class of the standard library (its name and the first line of its docstring)
and each of pydoc's help topics becomes a few instructions of the kinds users send a small assistant:
explain, use in code, compare, debug. Each pure-Python function with a docstring also becomes a code
completion task, its signature and docstring in a code block: the form code benchmarks such as HumanEval
ask in (``evaluation/evalsets.py``), with the standard library's functions, never theirs. The set is deterministic (sorted names, a fixed seed), so two
runs train on the same rows; HumanEval's prompts never appear in it (they are not stdlib docstrings).

    python bench/offline_prompts.py out.jsonl --count 6000
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import logging
import random
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

# Modules whose import has side effects (a GUI, a REPL, `this` printing the Zen) or that are platform-only.
SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "msilib", "winreg", "winsound",
        "_msi", "nt", "msvcrt", "crypt", "nis", "ossaudiodev", "spwd", "lib2to3", "pydoc_data", "ensurepip",
        "venv", "__phello__", "__hello__", "idle", "xxlimited", "xxsubtype", "xxlimited_35"}

OBJECT_TEMPLATES = [
    "Explain what `{name}` does in Python and show a short example.",
    "Write a small Python function that uses `{name}`. The docs say: \"{doc}\"",
    "When should I use `{name}`, and what is a common mistake with it?",
    "Give me three practical uses of `{name}` in everyday Python code.",
    "My code calls `{name}` and does not do what I expect. What should I check first?",
    "Summarise in two sentences: {doc}",
]
# The wording HumanEval's prompts are asked in (evaluation/evalsets.py), kept apart so a change there
# is a choice here too.
COMPLETION_WORDING = "Complete this Python function:\n```python\n{code}```"
TOPIC_TEMPLATES = [
    "Explain the Python concept \"{name}\" to a beginner.",
    "Write a short, correct example that demonstrates Python's {name}.",
]


def first_line(doc: str | None) -> str:
    line = (doc or "").strip().splitlines()[0].strip() if (doc or "").strip() else ""
    return line.rstrip(".") if 12 <= len(line) <= 160 else ""


def public_objects() -> Iterator[tuple[str, str, object]]:
    """``(module name, attribute, object)`` of every public attribute of each importable stdlib module, in
    sorted order; both prompt sources below pick from it."""
    for module_name in sorted(sys.stdlib_module_names):
        if module_name.startswith("_") or module_name in SKIP:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 — a module this platform lacks is simply not a source
            continue
        for attr in sorted(getattr(module, "__all__", None) or dir(module)):
            if not attr.startswith("_"):
                yield module_name, attr, getattr(module, attr, None)


def documented_objects() -> Iterator[tuple[str, str]]:
    """``(qualified name, first docstring line)`` of public functions and classes, module by module."""
    for module_name, attr, obj in public_objects():
        if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
            continue
        if (getattr(obj, "__module__", None) or module_name).split(".")[0] != module_name:
            continue  # re-exported from elsewhere: counted where it is defined
        doc = first_line(inspect.getdoc(obj))
        if doc:
            yield f"{module_name}.{attr}", doc


def completion_tasks() -> Iterator[str]:
    """A "complete this function" prompt per pure-Python stdlib function: its signature and docstring
    (up to the first blank line), the body left for the model to write; a function two modules expose
    under one name is asked once."""
    seen: set[str] = set()
    for module_name, attr, obj in public_objects():
        if not inspect.isfunction(obj) or obj.__module__ != module_name:
            continue
        doc = (inspect.getdoc(obj) or "").split("\n\n")[0].strip()
        try:
            signature = str(inspect.signature(obj))
        except (TypeError, ValueError):
            continue
        if not (20 <= len(doc) <= 600 and len(signature) <= 120 and '"""' not in doc):
            continue
        indented = "\n    ".join(doc.splitlines())
        code = f'def {attr}{signature}:\n    """{indented}\n    """\n'
        try:  # a default shown by its repr (``<class 'dict'>``) is no Python a model should copy
            ast.parse(code + "    pass\n")
        except SyntaxError:
            continue
        if code not in seen:
            seen.add(code)
            yield COMPLETION_WORDING.format(code=code)


def help_topics() -> list[str]:
    from pydoc_data.topics import topics

    return sorted(name.replace("-", " ") for name in topics)


def prompts(count: int, seed: int = 0) -> list[dict]:
    """``count`` prompts, every code-completion task among them first: there are few of them (about 570 of
    12,000) and they are the only rows in the form code benchmarks ask in, so a sample of the whole pool
    would keep under half of them. The rest is a seeded sample of the prose prompts; the result is shuffled
    (the run's held-out rows then mix both kinds)."""
    prose = [t.format(name=name, doc=doc) for name, doc in documented_objects() for t in OBJECT_TEMPLATES]
    prose += [t.format(name=name) for name in help_topics() for t in TOPIC_TEMPLATES]
    code = list(dict.fromkeys(completion_tasks()))
    prose = [p for p in dict.fromkeys(prose) if p not in set(code)]  # one of each
    rng = random.Random(seed)
    rng.shuffle(code)
    rng.shuffle(prose)
    if len(code) + len(prose) < count:
        raise SystemExit(f"only {len(code) + len(prose)} prompts available, {count} asked for")
    chosen = (code + prose)[:count]
    rng.shuffle(chosen)
    return [{"prompt": p} for p in chosen]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=6000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = prompts(args.count, args.seed)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    log.info("%d prompts written to %s", len(rows), args.out)


if __name__ == "__main__":
    main()
