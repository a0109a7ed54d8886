"""The trainer benchmark runs end to end on a tiny configuration on the CPU (one process, gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_trainer_benchmark_times_profiles_and_counts_flops(tmp_path):
    out, profiles = tmp_path / "results.json", tmp_path / "profiles"
    command = [sys.executable, str(REPO / "bench" / "bench_train_ddp.py"), "--work", str(tmp_path / "work"),
               "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128", "--vocab", "1024",
               "--draft-vocab", "256", "--length", "96,64", "--steps", "6", "--warmup", "2", "--procs", "1",
               "--batch-sizes", "2", "--attention", "dense", "--precision", "bf16", "--profile-steps", "1", "--profile-dir", str(profiles),
               "--device", "cpu", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, cwd=REPO, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    assert (result["attention"], result["precision"], result["timed_steps"]) == ("dense", "bf16", 3)  # 6 - 2 warm-up - 1 profiled
    # Samples alternate 96 and 64 tokens; length batching pairs equal ones, so a step trains 192 or 128
    # tokens, and the timed steps' mean is one of these (an order that mixed them would give 160).
    per_step = result["tokens_per_s"] / result["steps_per_s"]
    assert min(abs(per_step - (192 * a + 128 * (3 - a)) / 3) for a in range(4)) < 0.5, per_step
    assert result["flops_per_token"] > 6 * result["trainable_params"]  # weights' forward and backward at least
    assert "aten::" in next(profiles.glob("profile-*.txt")).read_text()
