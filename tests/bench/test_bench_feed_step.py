"""The feed's per-step benchmark runs on a real redis-server and reports each part of a step's bookkeeping."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_feed_benchmark_times_every_step_of_two_epochs(tmp_path):
    out = tmp_path / "feed.json"
    command = [sys.executable, str(REPO / "bench" / "bench_feed_step.py"), "--samples", "48", "--batch", "8",
               "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["steps"] == 2 * 48 // 8  # every batch of both epochs was waited for, looked past and released
    assert report["released"] > 0 and report["evicted"] == 0  # an extraction never late leaves nothing to evict
    for part in ("total", "wait", "look_ahead", "after_step", "report"):
        assert report[part]["median_ms"] >= 0 and report[part]["p90_ms"] >= report[part]["median_ms"], part
    assert report["total"]["mean_ms"] > 0
