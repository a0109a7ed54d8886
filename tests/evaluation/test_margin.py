"""The margin of one proposer over another on the same prompts: the difference of acceptance lengths as the
evaluator defines them, and a bootstrap interval that agrees with an independent (delta-method) estimate."""

from __future__ import annotations

import numpy as np
import pytest

from evaluation.margin import MIN_PROMPTS, paired_difference


def test_the_difference_is_of_ratios_of_sums_not_a_mean_of_ratios():
    a = [(10, 2), (2, 2)] * 5  # 12 emitted in 4 passes a pair: 3.0 (the mean of the prompts' ratios, 3.0 too)
    b = [(10, 10), (2, 1)] * 5  # 12 in 11: a mean of ratios would give 1.5
    found = paired_difference(a, b)
    assert found["difference"] == pytest.approx(3.0 - 12 / 11)
    assert found["low"] < found["difference"] < found["high"]
    assert (found["prompts"], found["level"], found["draws"]) == (10, 0.95, 2000)


def test_too_few_prompts_give_the_difference_without_an_interval():
    few = paired_difference([(10, 2), (2, 2)], [(10, 10), (2, 1)])
    assert few["difference"] == pytest.approx(3.0 - 12 / 11) and (few["low"], few["high"]) == (None, None)
    assert few["prompts"] == 2 < MIN_PROMPTS  # two prompts resample into three distinct draws: no spread to trust


def test_identical_proposers_or_a_constant_gap_leave_no_spread():
    rows = [(30, 12), (18, 9), (40, 25)] * 4
    same = paired_difference(rows, rows)
    assert (same["difference"], same["low"], same["high"]) == (0.0, 0.0, 0.0)
    faster = [(e, p) for e, p in [(20, 10)] * 10]
    slower = [(e, p) for e, p in [(20, 20)] * 10]
    gap = paired_difference(faster, slower)
    assert (gap["difference"], gap["low"], gap["high"]) == (1.0, 1.0, 1.0)


def delta_method_half_width(a: np.ndarray, b: np.ndarray, z: float = 1.959964) -> float:
    """The textbook linearization of Σe_a/Σp_a − Σe_b/Σp_b over n paired prompts, independent of the bootstrap."""
    ra, rb = a[:, 0].sum() / a[:, 1].sum(), b[:, 0].sum() / b[:, 1].sum()
    influence = (a[:, 0] - ra * a[:, 1]) / a[:, 1].mean() - (b[:, 0] - rb * b[:, 1]) / b[:, 1].mean()
    return z * influence.std(ddof=1) / np.sqrt(len(a))


def synthetic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Replies of 20-200 tokens; a drafter accepting ~1.9 a pass and lookup ~1.4, correlated through the reply."""
    rng = np.random.default_rng(seed)
    emitted = rng.integers(20, 200, n)
    easy = rng.uniform(0.8, 1.2, n)  # how repetitive each reply is: helps both proposers
    drafter = np.maximum(1, np.round(emitted / (1.9 * easy * rng.uniform(0.9, 1.1, n)))).astype(int)
    lookup = np.maximum(1, np.round(emitted / (1.4 * easy ** 2 * rng.uniform(0.85, 1.15, n)))).astype(int)
    return np.stack([emitted, drafter], 1), np.stack([emitted, lookup], 1)


def test_the_interval_agrees_with_the_delta_method_and_narrows_with_more_prompts():
    a, b = synthetic(400, seed=1)
    found = paired_difference(a.tolist(), b.tolist())
    half = (found["high"] - found["low"]) / 2
    assert half == pytest.approx(delta_method_half_width(a, b), rel=0.15)
    assert found["low"] < found["difference"] < found["high"]
    small = paired_difference(a[:100].tolist(), b[:100].tolist())
    assert small["high"] - small["low"] > 1.5 * (found["high"] - found["low"])  # a quarter of the prompts: ~2x wider


def test_the_same_counts_give_the_same_interval_every_time():
    a, b = synthetic(50, seed=2)
    assert paired_difference(a.tolist(), b.tolist()) == paired_difference(a.tolist(), b.tolist())


def test_counts_over_different_prompts_or_none_are_refused_or_empty():
    with pytest.raises(ValueError, match="different prompts"):
        paired_difference([(3, 1)], [(3, 1), (2, 1)])
    assert paired_difference([], []) is None
    assert paired_difference([(0, 0)], [(1, 1)]) is None  # nothing verified: no acceptance length to compare
