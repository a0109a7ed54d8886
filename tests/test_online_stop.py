"""A trainer told to stop, as real processes: an online run's trainer gets SIGTERM mid-epoch, as `docker compose stop
trainer` sends it, checkpoints at its next step boundary and exits; its train job goes back to the front of the
queue; started again, it resumes at exactly that step. Stopped twice, the run still holds every step once, each
epoch's batches as the plan orders them, and each sample once per epoch. (A second SIGTERM stopping a forking worker
at once is tests/runtime/test_worker.py's.)"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter

import httpx
import pytest
import redis

from services.cli.stack import LocalStack, StackConfig
from services.trainer import checkpoint as ckpt
from services.trainer.batching import LENGTH
from services.trainer.sources import epoch_plan
from shared.jobs import TRAIN_QUEUE, train_job_id
from shared.layout import RunPaths
from shared.runspec import TrainConfig
from tests.support.runs import status_or_none, wait_terminal
from tests.test_pipeline import write_dataset

pytestmark = [pytest.mark.slow, pytest.mark.online]

RUN = "online-stop"
EPOCHS = 3
TRAIN = {"epochs": EPOCHS, "batch_size": 4, "ttt_steps": 2, "draft_vocab_size": 128, "max_length": 128,
         "save_every": 1000, "validation_files": 2}  # no scheduled checkpoint but the last: the stop's is its own
STOP_WITHIN_S = 60.0  # a step and a checkpoint of the tiny target, on a loaded 2-core machine, with room to spare


def trained(stack: LocalStack) -> tuple[int, int]:
    """(steps done, steps in all) of the run's training, (0, 0) before it starts."""
    train = ((status_or_none(stack, RUN) or {}).get("stages") or {}).get("train") or {}
    return train.get("done", 0), train.get("total") or 0


def wait_until_trained(stack: LocalStack, share: float, timeout: float = 420.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, total = trained(stack)
        if total and done >= share * total:
            return done
        time.sleep(0.2)
    raise AssertionError(f"training did not reach {share:.0%} within {timeout:.0f}s")


def signal_worker(stack: LocalStack, sig: int) -> None:
    """What `docker compose stop` does: the signal to the worker process alone (its container's init forwards it to
    that one process), not to the job it runs."""
    os.kill(stack.processes("trainer")[0].pid, sig)


def exit_seconds(stack: LocalStack, timeout: float) -> float:
    started = time.monotonic()
    stack.processes("trainer")[0].wait(timeout)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, redis_server, tiny_model_dir):
    root = tmp_path_factory.mktemp("online-stop")
    data, dataset = root / "data", root / "prompts.jsonl"
    write_dataset(dataset, rows=64)
    config = StackConfig(data=data, model_dir=tiny_model_dir, log_dir=root / "logs", redis_url=redis_server.url,
                         env={"DRAFTLINE_DATASET_ROOTS": str(root)}, replicas={"generator": 1, "extractor": 2})
    paths = RunPaths(data, RUN)
    seen: dict = {}
    with LocalStack(config) as stack:
        body = {"dataset": str(dataset), "name": RUN, "generation": {"max_tokens": 24, "min_completion_tokens": 4},
                "train": TRAIN, "evaluate": {"holdout": 4, "max_new_tokens": 8, "draft_steps": 2, "sets": ["holdout"],
                                             "curve_max_steps": 2},
                "online": {"enabled": True, "budget_bytes": 600_000}}
        response = httpx.post(f"{stack.url('controller')}/runs", json=body, timeout=60)
        assert response.status_code == 201, response.text

        wait_until_trained(stack, 0.3)
        signal_worker(stack, signal.SIGTERM)
        seen["warm_exit_s"] = exit_seconds(stack, STOP_WITHIN_S)
        seen["log_at_stop"] = [json.loads(line) for line in paths.train_log.read_text().splitlines()]
        found = ckpt.latest_checkpoint(paths.checkpoints_dir)
        seen["checkpoint_at_stop"] = ckpt.read_checkpoint_state(found)["position"]["step"] if found else None
        queued = redis.Redis.from_url(redis_server.url).lrange(f"rq:queue:{TRAIN_QUEUE}", 0, -1)
        seen["queued_at_stop"] = [job.decode() for job in queued]
        seen["status_at_stop"] = status_or_none(stack, RUN)
        stack.respawn("trainer", 0)

        wait_until_trained(stack, 0.7)
        signal_worker(stack, signal.SIGTERM)
        seen["second_exit_s"] = exit_seconds(stack, STOP_WITHIN_S)
        stack.respawn("trainer", 0)

        seen["status"] = wait_terminal(stack, RUN, timeout=600.0)
    seen["log"] = [json.loads(line) for line in paths.train_log.read_text().splitlines()]
    seen["plan"] = json.loads(paths.online_plan.read_text())
    return seen


def test_the_first_sigterm_checkpoints_at_the_step_boundary_and_the_trainer_exits(stopped_run):
    assert stopped_run["warm_exit_s"] < STOP_WITHIN_S
    steps = [record["step"] for record in stopped_run["log_at_stop"]]
    assert steps == list(range(1, len(steps) + 1)) and steps  # stopped mid-run, every step logged once
    assert stopped_run["checkpoint_at_stop"] == steps[-1]  # no step lost: the checkpoint is where it stopped
    assert stopped_run["queued_at_stop"][:1] == [train_job_id(RUN)]  # back at the front of its queue
    train = stopped_run["status_at_stop"]["stages"]["train"]
    assert train["state"] != "failed" and train["done"] == steps[-1] < train["total"]


def test_the_resumed_run_holds_every_step_once_in_the_plans_order_and_each_sample_once_per_epoch(stopped_run):
    assert stopped_run["status"]["state"] in ("complete", "complete_with_failures"), stopped_run["status"]
    log, plan = stopped_run["log"], stopped_run["plan"]
    assert [record["step"] for record in log] == list(range(1, len(log) + 1))
    # An uninterrupted run trains each epoch's batches as the plan orders them: so did this one, through both stops.
    lengths = [min(n, TRAIN["max_length"]) for n in plan["tokens"]]
    ids = plan["train_ids"]
    expected = [[ids[i] for i in batch] for epoch in range(EPOCHS)
                for batch in epoch_plan(TrainConfig(**TRAIN), lengths, epoch, 1, LENGTH)]
    assert [record["samples"] for record in log] == expected
    for epoch in range(EPOCHS):
        assert Counter(i for r in log if r["epoch"] == epoch for i in r["samples"]) == Counter(ids), epoch
