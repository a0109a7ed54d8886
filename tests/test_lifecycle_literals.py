"""A sample's lifecycle is written down once, in ``shared/lifecycle.py``: no other module of the product spells a
stage or an outcome as a string. A module that needs one names the member (``Stage.EXTRACT``, ``Outcome.DONE``,
``StageState.FAILED``), so renaming a stage, or finding every reader of an outcome, is one search away.

The walk reads every string constant with ``ast`` (docstrings aside: they describe, they do not decide), in
the product's packages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from shared.lifecycle import Outcome, Stage, StageState

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "runtime", "modeling", "evaluation", "services")
HOME = REPO / "shared" / "lifecycle.py"
WORDS = frozenset({*Stage, *Outcome, StageState.SKIPPED})
# The same words with another meaning, each spelled once as a named constant beside its reason.
OTHER_MEANINGS = {
    ("shared/runspec.py", "train"): "DEFAULT_SPLIT: the split a hub dataset names its training rows",
    ("services/controller/runs/preflight.py", "failed"): "FAILED_CHECKS: the key of a preflight report's failed checks",
}


def docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def lifecycle_literals(path: Path, source: str | None = None) -> list[str]:
    """``path:line "word"`` for every string constant in ``path`` (or ``source``) that is a stage or an outcome."""
    text = path.read_text(encoding="utf-8") if source is None else source
    tree = ast.parse(text, filename=str(path))
    skip = docstrings(tree)
    return [f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in WORDS
            and id(node) not in skip]


def product_modules() -> list[Path]:
    return sorted(p for package in PACKAGES if (REPO / package).is_dir() for p in (REPO / package).rglob("*.py")
                  if p != HOME)


def test_no_module_but_the_lifecycle_spells_a_stage_or_an_outcome():
    found = [hit for path in product_modules() for hit in lifecycle_literals(path)]
    other = [hit for hit in found if (hit.split(":")[0], ast.literal_eval(hit.split(" ", 1)[1])) in OTHER_MEANINGS]
    assert [hit for hit in found if hit not in other] == []
    assert len(other) == len(OTHER_MEANINGS)  # each other meaning spelled exactly once, where it is listed


@pytest.mark.parametrize(("source", "hits"), [
    ('stage = "extract"\n', ["'extract'"]),
    ('counts = {"done": 1, "dropped": 2}\n', ["'done'", "'dropped'"]),
    ('def f():\n    """A docstring may say done."""\n    return f"{x}_done"\n', []),
    ('state = "skipped"\n', ["'skipped'"]),
])
def test_the_walk_finds_a_spelled_stage_or_outcome_and_passes_over_docstrings(source, hits):
    # The rule must be able to fail: a literal is named, a docstring and an f-string's text are not literals.
    path = REPO / "services" / "probe.py"
    assert [hit.split(" ", 1)[1] for hit in lifecycle_literals(path, source)] == hits
