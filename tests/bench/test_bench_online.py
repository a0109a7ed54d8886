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
    assert figures["offline_peak_run_bytes"] == figures["offline_run_bytes"]  # offline keeps every file to the end
    twin = figures["twins"]["0.33"]
    assert 0 < twin["online_budget_bytes"] < figures["offline_run_bytes"] / 3
    assert 0 < twin["online_peak_run_bytes"] < figures["offline_peak_run_bytes"]
    # Past the budget the trainer lets through one file at most: the one it waits for.
    assert twin["online_peak_run_bytes"] <= twin["online_budget_bytes"] + twin["online_largest_file_bytes"]
    assert twin["peak_within_budget_plus_one_file_per_extractor"] is True
    paired = twin["online_minus_offline_acceptance"]["holdout"]
    assert set(paired) == {"1", "2"} and all(one["prompts"] == 4 for one in paired.values())
    assert 0 <= twin["online_train_wait_fraction"] <= 1 and twin["online_released_files"] > 0
    assert twin["online_over_offline_train_time"] > 0 and figures["offline_train_seconds"] > 0
    # The offline training divided by is a retrain timed just before the twin, not the capture's (a cold compile).
    assert figures["offline_capture_train_seconds"] > 0
    epochs = figures["run"]["train"]["epochs"]
    assert len(figures["offline_epoch_seconds"]) == len(twin["online_epoch_seconds"]) == epochs
    assert twin["online_over_offline_last_epoch_time"] == pytest.approx(
        twin["online_epoch_seconds"][-1] / figures["offline_epoch_seconds"][-1], abs=1e-3)
    # Each epoch's median step split between its data and the step itself, for both runs.
    for split in ("median_data_seconds", "median_step_seconds"):
        assert len(figures[f"offline_{split}"]) == len(twin[f"online_{split}"]) == epochs
        assert all(x >= 0 for x in figures[f"offline_{split}"] + twin[f"online_{split}"])
    assert min(figures["offline_median_step_seconds"] + twin["online_median_step_seconds"]) > 0
    # The budget never forces a checkpoint: the trainer saves where train.save_every says, and at the end.
    assert twin["online_checkpoints"] == twin["online_expected_checkpoints"] != []
    assert twin["online_evicted_files"] == 0
    # The offline run's batches, unless the budget could not hold two of the longest: then those are cut smaller.
    capped = twin["online_batch_token_cap"] is not None
    assert twin["online_steps"] > figures["offline_steps"] if capped else twin["online_steps"] == figures["offline_steps"]
