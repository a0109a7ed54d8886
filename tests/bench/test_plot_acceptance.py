"""The acceptance plot's lines (bench/plot_acceptance.py): the run's drafter, prompt lookup and no drafter per
evaluation set, and every swept variant evaluated on that set beside them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from plot_acceptance import curves, held_out_lines  # noqa: E402

RUN = {"evaluation": {
    "holdout": {"drafter_method": "eagle3", "prompts": 4, "drafter": {"curve": {"2": 1.7, "1": 1.5}},
                "lookup": {"curve": {"1": 1.2, "2": 1.3}}, "no_drafter": {"acceptance_length": 1.0}},
    "humaneval": {"drafter_method": "eagle3", "prompts": 3, "drafter": {"curve": {"1": 1.4, "2": 1.6}},
                  "lookup": {"curve": {"1": 1.3, "2": 1.5}}, "no_drafter": {"acceptance_length": 1.0}},
}}
SWEEP = {"variants": {"dflash": {"train": {"method": "dflash"},
                                 "sets": {"holdout": {"curve": {"1": 1.6, "2": 1.9}}}}}}


def test_the_run_alone_has_its_three_lines_per_set_in_k_order():
    lines = curves(RUN)
    assert lines["holdout"] == {"drafter": [(1, 1.5), (2, 1.7)], "lookup": [(1, 1.2), (2, 1.3)],
                                "no_drafter": [(1, 1.0), (2, 1.0)]}
    assert set(lines) == {"holdout", "humaneval"}


def test_a_swept_variant_is_drawn_on_the_sets_it_was_evaluated_on():
    lines = curves(RUN, (SWEEP,))
    assert lines["holdout"]["sweep:dflash (DFlash)"] == [(1, 1.6), (2, 1.9)]
    assert not any(name.startswith("sweep:") for name in lines["humaneval"])  # not evaluated there: no line
    assert lines["holdout"]["drafter"] == curves(RUN)["holdout"]["drafter"]  # the run's own lines unchanged


def test_the_held_out_curve_is_one_line_per_k_over_the_training_steps():
    figures = {**RUN, "validation_curve": [
        {"step": 1000, "epoch": 0, "files": 256, "curve": {"1": 1.4, "3": 1.7, "10": 1.9}},
        {"step": 500, "epoch": 0, "files": 256, "curve": {"1": 1.3, "3": 1.5, "10": 1.6}},
    ]}
    assert held_out_lines(figures) == {"1": [(500, 1.3), (1000, 1.4)], "3": [(500, 1.5), (1000, 1.7)],
                                       "10": [(500, 1.6), (1000, 1.9)]}
    assert held_out_lines(RUN) == {}  # no files held out: no panel
