"""The orchestration benchmark runs end to end on a tiny configuration and reports every figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_orchestration_benchmark_settles_both_stages_and_measures_redis(tmp_path, tiny_model_dir):
    out = tmp_path / "out.json"
    command = [sys.executable, str(REPO / "bench" / "bench_orchestration.py"), "--samples", "12", "--generators", "1",
               "--extractors", "1", "--generate-batch", "4", "--work", str(tmp_path / "work"), "--json", str(out),
               "--timeout-s", "300"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=400,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["generated"], report["extracted"]) == (12, 12)
    assert report["extract_jobs_waiting"] == 12  # generation queued one extract job per sample, none ran yet
    assert report["generate_samples_per_s_stub"] > 0 and report["extract_samples_per_s_stub"] > 0
    assert report["redis_bytes_per_inflight_sample"] > 0
    assert all(rss > 0 for rss in report["worker_rss_bytes"]["generator"] + report["worker_rss_bytes"]["extractor"])
