"""The online benchmark runs end to end on the tiny target (its figures are measured with SmolLM2, never here) and
writes every figure bench/RESULTS.md and bench/results.json take from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.processes import REPO

pytestmark = [pytest.mark.slow, pytest.mark.online]


def test_the_benchmark_runs_an_offline_run_and_its_online_twin(tmp_path, tiny_model_dir, redis_url):
    out = tmp_path / "figures.json"
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "bench/bench_online.py", "--data", str(tmp_path / "data"), "--conversations", "60", "--small",
         "--model-dir", str(tiny_model_dir), "--budget-share", "0.33", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    figures = json.loads(out.read_text())
    assert 0 < figures["online_budget_bytes"] < figures["offline_run_bytes"] / 3
    assert figures["offline_peak_run_bytes"] == figures["offline_run_bytes"]  # offline keeps every file to the end
    assert 0 < figures["online_peak_run_bytes"] < figures["offline_peak_run_bytes"]
    # Past the budget the trainer lets through one file at most: the one it waits for.
    assert figures["online_peak_run_bytes"] <= figures["online_budget_bytes"] + figures["online_largest_file_bytes"]
    assert figures["peak_within_budget_plus_one_file_per_extractor"] is True
    paired = figures["online_minus_offline_acceptance"]["holdout"]
    assert set(paired) == {"1", "2"} and all(one["prompts"] == 4 for one in paired.values())
    assert 0 <= figures["online_train_wait_fraction"] <= 1 and figures["online_released_files"] > 0
