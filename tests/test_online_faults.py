"""An online run through faults, as real processes: the trainer SIGKILLed mid-epoch, an extractor SIGKILLed, Redis
restarted empty and the controller SIGKILLed, each while training runs. The run completes, every sample trains
exactly once per epoch, no file is torn or orphaned, and the spool's counts equal the volume."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter

import httpx
import pytest

from runtime.runstate import finished_path
from services.cli.stack import LocalStack, StackConfig
from shared.atomic import temp_files
from shared.hidden_file import verify_hidden_file
from shared.layout import RunPaths
from tests.support.processes import RedisServer
from tests.support.runs import status_or_none
from tests.test_pipeline import write_dataset

pytestmark = [pytest.mark.slow, pytest.mark.online]

RUN = "online-faults"
EPOCHS = 3
BUDGET = 600_000
FINISH_SECONDS = 420
# Each fault once training has taken this share of its steps.
FAULTS = ((0.2, "kill-trainer"), (0.35, "kill-extractor"), (0.5, "redis"), (0.65, "kill-controller"))


def status(stack: LocalStack) -> dict | None:
    return status_or_none(stack, RUN)


def trained_share(stack: LocalStack) -> float:
    current = status(stack)
    train = (current or {}).get("stages", {}).get("train", {})
    return train.get("done", 0) / train["total"] if train.get("total") else 0.0


def inject(stack: LocalStack, redis_server: RedisServer, fault: str) -> None:
    if fault == "redis":
        redis_server.stop()
        time.sleep(1.0)
        redis_server.start()  # same port, empty: no persistence
        return
    name = fault.removeprefix("kill-")
    stack.kill(name, 0, signal.SIGKILL)
    time.sleep(0.5)
    stack.respawn(name, 0)


@pytest.fixture(scope="module")
def faulted_run(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("online-faults")
    redis_server = RedisServer(root / "redis").start()
    data, dataset = root / "data", root / "prompts.jsonl"
    write_dataset(dataset, rows=124)
    config = StackConfig(data=data, model_dir=tiny_model_dir, log_dir=root / "logs", redis_url=redis_server.url,
                         replicas={"generator": 1, "extractor": 2}, env={"DRAFTLINE_DATASET_ROOTS": str(root)})
    injected: list[str] = []
    try:
        with LocalStack(config) as stack:
            body = {
                "dataset": str(dataset), "name": RUN,
                "generation": {"max_tokens": 24, "min_completion_tokens": 4},
                "train": {"epochs": EPOCHS, "batch_size": 4, "ttt_steps": 2, "draft_vocab_size": 128,
                          "max_length": 128, "save_every": 4, "validation_files": 2},
                "evaluate": {"holdout": 4, "max_new_tokens": 8, "draft_steps": 2, "sets": ["holdout"],
                             "curve_max_steps": 2},
                "online": {"enabled": True, "budget_bytes": BUDGET, "vocab_files": 8},
            }
            response = httpx.post(f"{stack.url('controller')}/runs", json=body, timeout=60)
            assert response.status_code == 201, response.text
            deadline = time.monotonic() + FINISH_SECONDS
            pending = list(FAULTS)
            final = None
            while time.monotonic() < deadline:
                for proc in list(stack.procs):
                    if proc.popen.poll() is not None:
                        stack.respawn(proc.name, stack.processes(proc.name).index(proc.popen))
                if pending and trained_share(stack) >= pending[0][0]:
                    inject(stack, redis_server, pending[0][1])
                    injected.append(pending.pop(0)[1])
                final = status(stack)
                if final and final["state"] in ("complete", "complete_with_failures", "failed") \
                        and finished_path(RunPaths(data, RUN)).exists():
                    break
                time.sleep(0.2)
    finally:
        redis_server.stop()
    return {"status": final, "data": data, "faults": injected, "logs": root / "logs"}


def test_every_fault_struck_while_training_ran_and_the_run_completed(faulted_run):
    assert faulted_run["faults"] == [fault for _, fault in FAULTS]
    assert faulted_run["status"]["state"] in ("complete", "complete_with_failures"), faulted_run["status"]


def test_every_sample_trained_exactly_once_per_epoch_through_the_faults(faulted_run):
    paths = RunPaths(faulted_run["data"], RUN)
    plan = json.loads(paths.online_plan.read_text())
    log = [json.loads(line) for line in paths.train_log.read_text().splitlines()]
    assert [record["step"] for record in log] == list(range(1, len(log) + 1))  # a resumed log holds each step once
    for epoch in range(EPOCHS):
        trained = Counter(i for record in log if record["epoch"] == epoch for i in record["samples"])
        assert trained == Counter(plan["train_ids"]), epoch


def test_no_file_is_torn_or_orphaned_and_the_counts_equal_the_volume(faulted_run):
    paths = RunPaths(faulted_run["data"], RUN)
    plan = json.loads(paths.online_plan.read_text())
    left = sorted(paths.hidden_dir.rglob("*.safetensors"))
    assert sorted(int(p.stem) for p in left) == sorted(plan["validation_ids"])
    for path in left:
        verify_hidden_file(path)
    assert temp_files(paths.root) == []
    online = faulted_run["status"]["online"]
    assert online["spool_files"] == len(left) and online["spool_bytes"] == sum(p.stat().st_size for p in left)
