"""How far one proposer's acceptance length lies above another's, and how sure that is over the prompts measured.

Both are measured on the same prompts, so the difference is paired: a prompt whose reply repeats itself
helps prompt lookup and the drafter alike. The interval is a percentile bootstrap over prompts: the prompts
drawn with replacement ``DRAWS`` times, both proposers' acceptance lengths (Σ emitted / Σ passes, the
evaluator's definition) computed on each draw, and the middle ``LEVEL`` of their differences kept. It says
how much the figure would move on another draw of prompts like these; it does not cover a retrained drafter
(another seed, another order of batches), which moves it further.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

DRAWS = 2000
LEVEL = 0.95
SEED = 0  # fixed: the same report gives the same interval every time it is computed
# Below this many prompts a resample has too few distinct draws (2 prompts give 3) and the interval understates
# the spread: the difference is reported without one.
MIN_PROMPTS = 10
CHUNK_ELEMENTS = 1 << 22  # draws x prompts held at once


def paired_difference(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]], *, draws: int = DRAWS,
                      level: float = LEVEL, seed: int = SEED) -> dict[str, Any] | None:
    """``a``, ``b``: (emitted, passes) per prompt of two proposers, the same prompts in the same order. The
    difference of their acceptance lengths, a − b, and its bootstrap interval (``low`` and ``high`` None under
    ``MIN_PROMPTS`` prompts); None without a pass to count."""
    if len(a) != len(b):
        raise ValueError(f"paired counts over different prompts: {len(a)} against {len(b)}")
    first, second = np.asarray(a, dtype=np.int64).reshape(-1, 2), np.asarray(b, dtype=np.int64).reshape(-1, 2)
    if not len(first) or not first[:, 1].sum() or not second[:, 1].sum():
        return None
    difference = ratio(first.sum(0)) - ratio(second.sum(0))
    found = {"difference": float(difference), "low": None, "high": None, "prompts": len(first), "level": level,
             "draws": draws}
    if len(first) < MIN_PROMPTS:
        return found
    rng = np.random.default_rng(seed)
    chunks, per_chunk = [], max(1, CHUNK_ELEMENTS // len(first))
    for start in range(0, draws, per_chunk):
        picks = rng.integers(0, len(first), size=(min(per_chunk, draws - start), len(first)))
        with np.errstate(divide="ignore", invalid="ignore"):  # a draw of prompts with no pass: left out below
            chunks.append(ratio(first[picks].sum(1)) - ratio(second[picks].sum(1)))
    spread = np.concatenate(chunks)
    spread = spread[np.isfinite(spread)]
    if not spread.size:
        return found
    low, high = np.quantile(spread, [(1 - level) / 2, (1 + level) / 2])
    return {**found, "low": float(low), "high": float(high)}


def ratio(sums: np.ndarray) -> np.ndarray:
    """Σ emitted / Σ passes of (..., 2) sums."""
    return sums[..., 0] / sums[..., 1]
