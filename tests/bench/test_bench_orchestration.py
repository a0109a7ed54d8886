"""The orchestration benchmark runs end to end on a tiny configuration and reports every figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def bench(tmp_path: Path, *options: str) -> dict:
    out = tmp_path / "out.json"
    command = [sys.executable, str(REPO / "bench" / "bench_orchestration.py"), *options, "--generators", "1",
               "--work", str(tmp_path / "work"), "--json", str(out), "--timeout-s", "300", "--interval-s", "0.2"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=400,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def assert_stage_measured(report: dict, stage: str, workers: int) -> None:
    detail = report["stage_detail"][stage]
    assert detail["series"] and detail["series"][-1]["settled"] == report["samples"]
    assert all(len(point["worker_rss_bytes"]) == workers for point in detail["series"])
    assert all(start > 0 and end > 0 and peak >= max(start, end)
               for start, end, peak in detail["worker_rss_start_end_peak_bytes"])
    assert detail["redis_used_memory_peak"] >= report["redis_used_memory"]["before"]
    redis = report["redis_commands_and_cpu"][stage]
    assert redis["polling_commands_per_s"] > 0
    for share in ("with_polling", "workers_only"):
        assert redis[share]["commands_per_sample"] > 0 and "info" not in redis[share]["by_command_per_sample"]
    assert redis["workers_only"]["commands"] < redis["with_polling"]["commands"]


def test_the_orchestration_benchmark_settles_both_stages_and_measures_redis(tmp_path, tiny_model_dir):
    report = bench(tmp_path, "--samples", "12", "--extractors", "1", "--generate-batch", "4")
    assert (report["generated"], report["extracted"]) == (12, 12)
    # Generation queued its replies' extractions, none ran yet: one extract job per generate job of 4 samples.
    assert (report["extract_jobs_waiting"], report["extract_samples_waiting"], report["extract_batch"]) == (3, 12, 16)
    assert report["generate_samples_per_s_stub"] > 0 and report["extract_samples_per_s_stub"] > 0
    assert report["redis_bytes_per_inflight_sample"] > 0
    assert all(rss > 0 for rss in report["worker_rss_bytes"]["generator"] + report["worker_rss_bytes"]["extractor"])
    assert report["sample_result_ttl_s"] == 0  # the setting's default reaches the feeder and the workers
    assert report["redis_bytes_per_sample_in_generate_jobs"] > 0
    for stage in ("generate", "extract"):
        assert_stage_measured(report, stage, workers=1)


def test_the_generate_only_benchmark_leaves_extraction_out_and_empties_its_queue_afterwards(tmp_path):
    report = bench(tmp_path, "--stages", "generate", "--samples", "40", "--generate-batch", "4",
                   "--sample-result-ttl-s", "60", "--extract-batch", "2")
    assert (report["generated"], report["extracted"], report["extractors"]) == (40, 0, 0)
    # Nothing paused generation, nothing extracted; the extract batch reached the generators.
    assert (report["extract_jobs_waiting"], report["extract_samples_waiting"], report["extract_batch"]) == (20, 40, 2)
    assert report["sample_result_ttl_s"] == 60 and list(report["stage_detail"]) == ["generate"]
    assert_stage_measured(report, "generate", workers=1)
    # The queue emptied, what is left is the run's own state and the finished generate jobs (kept 60 s).
    assert report["redis_used_memory"]["after"] < report["redis_used_memory"]["extract_jobs_waiting"]
    assert report["redis_keys_after_run"] >= 10 + 1  # the finished generate jobs, the run's keys


def test_the_benchmark_extracts_against_the_stand_in_server_with_every_file_verified(tmp_path, tiny_model_dir):
    report = bench(tmp_path, "--samples", "12", "--extractors", "1", "--generate-batch", "4",
                   "--extract-server", "stub")
    assert (report["generated"], report["extracted"], report["extract_failed"]) == (12, 12, 0)
    assert report["extract_server"] == "stub" and report["extract_samples_per_s_stub"] > 0
    assert_stage_measured(report, "extract", workers=1)
    files = sorted((tmp_path / "work" / "data").rglob("*.safetensors"))
    assert len(files) == 12  # written by the stand-in, each verified by the extractor before it counted
