"""`make test-models` builds every model a test caches, so none is built inside a test's time-out."""

from __future__ import annotations

import ast

from tests.support.cached_models import BUILDERS
from tests.support.processes import REPO

# Helpers of the cache itself, not models.
NOT_MODELS = {"cached_model"}


def model_cache_functions() -> set[str]:
    """Every top-level ``cached_*`` function under tests/: each returns a cached model's directory."""
    found = set()
    for path in (REPO / "tests").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("cached_") and node.name not in NOT_MODELS:
                found.add(node.name)
    return found


def test_the_set_up_builds_every_cached_test_model() -> None:
    assert {build.__name__ for build in BUILDERS} == model_cache_functions()
