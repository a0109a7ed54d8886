"""Run settings: what run.json files written before a field existed load as."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from shared.layout import RunPaths
from shared.runspec import EvalConfig, RunSpec


def test_a_run_json_from_before_the_evaluation_sets_loads_with_their_defaults(tmp_path):
    paths = RunPaths(tmp_path, "old")
    paths.root.mkdir(parents=True)
    # The evaluate section as runs stored it before sets, curve and baselines existed.
    old = {"name": "old", "dataset": "d.jsonl", "model": "m",
           "evaluate": {"holdout": 5, "max_new_tokens": 32, "draft_steps": 2}}
    paths.spec.write_text(json.dumps(old))
    cfg = RunSpec.load(tmp_path, "old").evaluate
    assert (cfg.holdout, cfg.max_new_tokens, cfg.draft_steps) == (5, 32, 2)
    assert cfg.sets == ["holdout", "humaneval"] and cfg.humaneval_limit is None
    assert cfg.curve_max_steps == 7 and cfg.baselines is True and (cfg.lookup_min, cfg.lookup_max) == (2, 5)


@pytest.mark.parametrize("bad", [{"sets": ["holdout", "holdout"]}, {"sets": []}, {"sets": ["mmlu"]},
                                 {"lookup_min": 4, "lookup_max": 3}, {"curve_max_steps": 0}, {"humaneval_limit": 0},
                                 {"unknown": 1}])
def test_evaluation_settings_that_cannot_mean_anything_are_refused(bad):
    with pytest.raises(ValidationError):
        EvalConfig(**bad)
