"""``draftline resume``, ``failures`` and ``retry`` as an operator runs them: subprocesses against a real
Redis and a volume."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from runtime.runstate import RunState, known_runs
from shared.lifecycle import Failure, FailureKind
from services.cli.commands.retry import resumed_line
from tests.services.controller.volume import fail_training, finish_samples, prompt_rows, submit
from tests.support.processes import REPO


def draftline(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli.main", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture()
def env(data_dir, redis_url) -> dict:
    return {**os.environ, "REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir)}


@pytest.fixture()
def state(data_dir, redis_conn, tmp_path) -> RunState:
    """12 rows (row 2 malformed, 11 held out); replies for 0-8, hidden states for 0-5, two failures."""
    state = submit(data_dir, redis_conn, tmp_path, "cli", prompt_rows(12, bad=(2,)))
    finish_samples(state, generated=[i for i in range(9) if i != 2], extracted=[i for i in range(6) if i != 2])
    for sample_id, kind in ((9, "error"), (10, FailureKind.DROPPED)):
        state.mark_failed(Failure(run="cli", stage="generate", sample_id=sample_id, error_class="InferenceRejected",
                                  message=f"sample {sample_id} refused", kind=kind))
    return state


def test_failures_lists_every_failure_as_json_and_text_even_without_redis(env, redis_conn, state):
    redis_conn.flushall()
    listed = json.loads(draftline(env, "failures", "cli", "--json").stdout)
    assert [(f["sample_id"], f["stage"], f["error_class"], f["kind"]) for f in listed] == [
        (2, "generate", "InvalidJson", "error"), (9, "generate", "InferenceRejected", "error"),
        (10, "generate", "InferenceRejected", "dropped")]
    assert set(listed[0]) == {"sample_id", "stage", "error_class", "message", "kind"}
    text = draftline(env, "failures").stdout  # the only run
    assert "3 failures" in text and "sample 9" in text and "sample 9 refused" in text
    assert json.loads(draftline(env, "failures", "--stage", "extract", "--json").stdout) == []


def test_resume_rebuilds_a_lost_run_and_names_what_it_redid(env, redis_conn, state):
    truncated = state.paths.hidden(4)
    truncated.write_bytes(truncated.read_bytes()[:-3])
    redis_conn.flushall()
    done = draftline(env, "resume", "cli")
    assert done.returncode == 0, done.stderr
    assert "verified  8 replies, 4 hidden-state files" in done.stdout
    assert "extract  sample 4" in done.stdout and "registered again" in done.stdout
    assert "cli" in known_runs(redis_conn) and state.counts("extract").done == 4
    report = json.loads(draftline(env, "resume", "--deep", "--json").stdout)
    assert report["deep"] is True and report["extracted"] == 4 and report["redone"] == []


def test_retry_clears_errors_and_says_what_it_cannot_retry(env, state):
    done = draftline(env, "retry", "cli", "--stage", "generate")
    assert done.returncode == 0, done.stderr
    assert "1 failures cleared" in done.stdout and "not retried: generate sample 2" in done.stdout
    assert not state.paths.failure("generate", 9).exists() and state.paths.failure("generate", 10).exists()
    assert state.counts("generate").failed == 1  # the malformed row only
    named = draftline(env, "retry", "10", "99")  # ids of the only run; a drop named by id is retried
    assert named.returncode == 0 and "no failure record for: 99" in named.stdout
    assert state.counts("generate").dropped == 0
    nothing = draftline(env, "retry", "cli")
    assert nothing.returncode == 1 and "0 failures cleared" in nothing.stdout


def test_without_a_run_name_the_latest_is_used_and_the_others_named(env, data_dir, redis_conn, tmp_path, state):
    submit(data_dir, redis_conn, tmp_path, "cli-later", prompt_rows(3))
    done = draftline(env, "failures", "--json")
    assert json.loads(done.stdout) == [] and "cli, cli-later" in done.stderr and "cli-later" in done.stderr
    missing = draftline(env, "resume", "nope")
    assert missing.returncode == 2 and "RunNotFound" in missing.stderr


def test_retry_of_a_run_whose_training_failed_says_the_checkpoint_it_resumes_from(env, data_dir, redis_conn, tmp_path):
    trained = submit(data_dir, redis_conn, tmp_path, "failed-train", prompt_rows(5))
    fail_training(trained, checkpoints=(25, 50))
    done = draftline(env, "retry", "failed-train")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "run failed-train: its failed train job is queued again; training resumes from its checkpoint at step 50\n"
    assert resumed_line("r", {"stage": "train", "checkpoint_step": None}) == (
        "run r: its failed train job is queued again; training starts over (no checkpoint was written)")
    assert resumed_line("r", {"stage": "evaluate", "checkpoint_step": None}) == "run r: its failed evaluate job is queued again"
