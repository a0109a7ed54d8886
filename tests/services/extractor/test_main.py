"""``draftline serve extractor`` refuses to start with a hidden-state source that lacks a setting, naming it."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_vllm_source_without_its_storage_stops_the_worker_at_start(tmp_path, tiny_model_dir):
    env = {**os.environ, "DRAFTLINE_DATA": str(tmp_path), "DRAFTLINE_MODEL_DIR": str(tiny_model_dir),
           "DRAFTLINE_HIDDEN_SOURCE": "vllm", "REDIS_URL": "redis://127.0.0.1:1/0"}
    env.pop("DRAFTLINE_VLLM_STORAGE", None)
    done = subprocess.run([sys.executable, "-m", "services.cli.main", "serve", "extractor"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "SourceMisconfigured" in done.stderr and "DRAFTLINE_VLLM_STORAGE" in done.stderr
