"""A run on a data volume too small for it: it pauses (visibly) before the disk fills, leaves no partial
file, and finishes by itself once the volume grows.

Real processes through LocalStack (the commands docker-compose.yml runs) on a size-limited tmpfs as the
data volume: 30 samples of the tiny target need about 2 MB of hidden states; the volume has 1 MiB.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import redis

from services.cli.demo import demo_prompts_path
from services.cli.stack import LocalStack, StackConfig
from services.controller.runs.status import format_status
from shared.atomic import temp_files
from runtime.disk import disk_status
from shared.hidden_file import verify_hidden_file
from shared.layout import RunPaths
from tests.support.tmpfs import fill_volume, mounted_tmpfs

pytestmark = pytest.mark.slow

RUN = "diskfull"
SAMPLES = 30
HOLDOUT = 2
VOLUME_BYTES = 1 << 20
GROWN_BYTES = 64 << 20
TERMINAL = ("complete", "complete_with_failures", "failed")


def write_dataset(path: Path) -> Path:
    prompts = demo_prompts_path().read_text().splitlines()
    path.write_text("\n".join(prompts[i % len(prompts)] for i in range(SAMPLES + HOLDOUT)) + "\n")
    return path


def stack_config(tmp_path: Path, volume: Path, model_dir: Path, redis_url: str) -> StackConfig:
    """The real services on ``volume``, checking it every 0.2 s against a 128 KiB reserve."""
    env = {"DRAFTLINE_FEED_INTERVAL_S": "0.2", "DRAFTLINE_DISK_RESERVE_BYTES": str(128 << 10),
           "DRAFTLINE_DISK_RESERVE_FRACTION": "0", "DRAFTLINE_DATASET_ROOTS": str(tmp_path)}
    return StackConfig(data=volume, model_dir=model_dir, log_dir=tmp_path / "logs", redis_url=redis_url, env=env)


def status_of(stack: LocalStack, run: str = RUN) -> dict:
    stack.check_alive()
    return httpx.get(f"{stack.url('controller')}/runs/{run}", timeout=30).json()


def fill_once_training(stack: LocalStack, run: str, neighbour: Path, deadline: float) -> None:
    """Once the run's trainer has taken two steps, another process's file takes the volume's free space."""
    while (shown := status_of(stack, run))["stages"]["train"]["done"] < 2:
        assert shown["state"] not in TERMINAL and time.monotonic() < deadline, shown
        time.sleep(0.1)
    fill_volume(neighbour)


def wait_settled(stack: LocalStack, run: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while (final := status_of(stack, run))["state"] not in TERMINAL:
        assert time.monotonic() < deadline, final
        time.sleep(0.5)
    return final


def server_ran_out_of_space(stack: LocalStack) -> bool:
    """Whether the inference server ever answered 507: the pause must come before the disk fills."""
    logs = [proc.log_path for proc in stack.procs if proc.name == "inference"]
    return any("no space left on the data volume" in path.read_text(errors="replace") for path in logs)


def wait_for(what: str, predicate, stack: LocalStack, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    status = {}
    while time.monotonic() < deadline:
        status = status_of(stack)
        if predicate(status):
            return status
        assert status["stages"]["extract"]["failed"] == 0, f"an extraction failed instead of waiting: {status}"
        assert status["state"] not in TERMINAL, f"the run ended before {what}: {status}"
        assert not server_ran_out_of_space(stack), f"the volume filled up before {what}: {status}"
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {status}")


def checked_since_pause(conn: redis.Redis) -> bool:
    shown = disk_status(conn, RUN)
    return bool(shown["paused"] and shown["checked_at"] and shown["checked_at"] >= shown["paused_at"])


def landed_files(paths: RunPaths) -> list[Path]:
    for path in paths.hidden_dir.rglob("*.safetensors"):
        verify_hidden_file(path)  # published files are whole: the rename is the last step
    return sorted(paths.hidden_dir.rglob("*.safetensors"))


def test_a_run_pauses_before_the_disk_fills_and_completes_when_the_volume_grows(tmp_path, redis_server,
                                                                                tiny_model_dir):
    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()
    dataset = write_dataset(tmp_path / "prompts.jsonl")
    with mounted_tmpfs(tmp_path / "volume", VOLUME_BYTES) as volume:
        config = stack_config(tmp_path, volume.path, tiny_model_dir, redis_server.url)
        paths = RunPaths(volume.path, RUN)
        with LocalStack(config) as stack:
            body = {
                "dataset": str(dataset), "name": RUN,
                "generation": {"max_tokens": 16, "min_completion_tokens": 2},
                "train": {"epochs": 1, "batch_size": 8, "lr": 2e-3, "ttt_steps": 2, "draft_vocab_size": 128,
                          "max_length": 128},
                "evaluate": {"holdout": HOLDOUT, "max_new_tokens": 8, "draft_steps": 2, "sets": ["holdout"],
                             "curve_max_steps": 2},
            }
            response = httpx.post(f"{stack.url('controller')}/runs", json=body, timeout=120)
            assert response.status_code == 201, response.text

            paused = wait_for("the disk pause", lambda s: s["disk"]["paused"], stack, timeout=120)
            assert paused["disk"]["paused"] is True and paused["disk"]["reason"], paused["disk"]
            # The pause comes from the supervisor's projection or from a sample's claim on its file's bytes,
            # whichever sees first that the rest does not fit; the supervisor's next check holds it either way.
            wait_for("a disk check since the pause", lambda s: checked_since_pause(conn), stack, timeout=60)
            shown = disk_status(conn, RUN)
            # Paused because what the rest needs does not fit above the reserve; that the pause comes before
            # the disk fills, wait_for checks throughout.
            assert shown["projected_bytes"] > shown["checked_free_bytes"] - shown["reserve_bytes"] >= 0
            assert shown["reserve_bytes"] == 128 << 10 and shown["bytes_per_token"] > 4 * 64 * 4
            assert str(volume.path) in shown["reason"]

            # Paused: what landed is whole, nothing half-written stays, and not every sample made it.
            wait_for("in-flight writes to settle", lambda s: not temp_files(paths.hidden_dir), stack, timeout=60)
            landed = landed_files(paths)
            assert len(landed) < SAMPLES
            assert disk_status(conn, RUN)["paused"]

            volume.resize(GROWN_BYTES)  # the operator grows the volume; nobody touches the run
            final = wait_for("the run to finish", lambda s: s["state"] in TERMINAL, stack, timeout=300)

        assert final["state"] == "complete", final
        extract = final["stages"]["extract"]
        assert extract["failed"] == 0 and extract["done"] == final["stages"]["generate"]["done"] > len(landed)
        assert len(landed_files(paths)) == extract["done"]
        assert temp_files(paths.root) == []
        assert disk_status(conn, RUN)["paused"] is False
        assert final["drafter"]["export_path"]


TRAINING_RUN = "fulltrain"


def test_a_volume_another_process_fills_during_training_holds_the_trainer_and_the_run_completes(
        tmp_path, redis_server, tiny_model_dir):
    """The projection fits, then a neighbour takes the volume's space while the drafter trains: the trainer's next
    write (a log line or a checkpoint) waits, status names the held stage, and once the neighbour's file goes the
    run completes with every step logged once and no partial file."""
    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()
    dataset = write_dataset(tmp_path / "prompts.jsonl")
    with mounted_tmpfs(tmp_path / "volume", GROWN_BYTES) as volume:
        config = stack_config(tmp_path, volume.path, tiny_model_dir, redis_server.url)
        paths, neighbour = RunPaths(volume.path, TRAINING_RUN), volume.path / "neighbour.bin"
        with LocalStack(config) as stack:
            body = {
                "dataset": str(dataset), "name": TRAINING_RUN,
                "generation": {"max_tokens": 16, "min_completion_tokens": 2},
                # Enough steps that the neighbour's file lands while the trainer still writes.
                "train": {"epochs": 40, "batch_size": 4, "lr": 2e-3, "ttt_steps": 2, "draft_vocab_size": 128,
                          "max_length": 128, "save_every": 20},
                "evaluate": {"holdout": HOLDOUT, "max_new_tokens": 8, "draft_steps": 2, "sets": ["holdout"],
                             "curve_max_steps": 2},
            }
            response = httpx.post(f"{stack.url('controller')}/runs", json=body, timeout=120)
            assert response.status_code == 201, response.text

            def status() -> dict:
                return status_of(stack, TRAINING_RUN)

            deadline = time.monotonic() + 300
            fill_once_training(stack, TRAINING_RUN, neighbour, deadline)
            while not (shown := status())["disk"]["held"]:
                assert shown["state"] not in TERMINAL and time.monotonic() < deadline, f"nothing waited: {shown}"
                time.sleep(0.2)
            assert shown["disk"]["holds"] == ["train"] and shown["stages"]["train"]["paused"] and shown["paused"]
            assert str(volume.path) in shown["disk"]["held"]["train"]
            assert "  PAUSED    train waits for disk space: writing " in format_status(shown)
            held_step = shown["stages"]["train"]["done"]
            time.sleep(2)
            assert status()["stages"]["train"]["done"] <= held_step + 1  # waiting, not training on
            assert status()["state"] == "training"

            neighbour.unlink()  # the neighbour's file goes; nobody touches the run
            final = wait_settled(stack, TRAINING_RUN, 300)

        assert final["state"] == "complete", final
        assert final["disk"]["held"] == {} and final["drafter"]["export_path"]
        steps = [json.loads(line)["step"] for line in paths.train_log.read_text().splitlines()]
        assert steps == list(range(1, final["stages"]["train"]["total"] + 1))  # each step once, no torn line
        assert temp_files(paths.root) == []


ONLINE_RUN = "fullonline"
ONLINE_EPOCHS = 3


@pytest.mark.online
def test_an_online_run_through_a_volume_another_process_fills_waits_and_completes(tmp_path, redis_server,
                                                                                 tiny_model_dir):
    """An online run trains while its extractions refill the spool; a neighbour takes the volume's space: the run
    waits with the reason named (extraction paused, or the trainer's writes held) and fails nothing; once the
    neighbour's file goes, it completes with every sample trained once per epoch, no partial file, only the
    held-out files left and the spool's counts equal to the volume."""
    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()
    dataset = write_dataset(tmp_path / "prompts.jsonl")
    with mounted_tmpfs(tmp_path / "volume", GROWN_BYTES) as volume:
        config = stack_config(tmp_path, volume.path, tiny_model_dir, redis_server.url)
        paths, neighbour = RunPaths(volume.path, ONLINE_RUN), volume.path / "neighbour.bin"
        with LocalStack(config) as stack:
            body = {
                "dataset": str(dataset), "name": ONLINE_RUN,
                "generation": {"max_tokens": 16, "min_completion_tokens": 2},
                "train": {"epochs": ONLINE_EPOCHS, "batch_size": 4, "lr": 2e-3, "ttt_steps": 2,
                          "draft_vocab_size": 128, "max_length": 128, "save_every": 4, "validation_files": 2},
                "evaluate": {"holdout": HOLDOUT, "max_new_tokens": 8, "draft_steps": 2, "sets": ["holdout"],
                             "curve_max_steps": 2},
                "online": {"enabled": True, "budget_bytes": 600_000, "vocab_files": 8},
            }
            response = httpx.post(f"{stack.url('controller')}/runs", json=body, timeout=120)
            assert response.status_code == 201, response.text

            def status() -> dict:
                return status_of(stack, ONLINE_RUN)

            deadline = time.monotonic() + 300
            fill_once_training(stack, ONLINE_RUN, neighbour, deadline)
            while not ((shown := status())["disk"]["paused"] or shown["disk"]["held"]):
                assert shown["state"] not in TERMINAL and time.monotonic() < deadline, f"nothing waited: {shown}"
                time.sleep(0.2)
            waiting = shown["disk"]
            assert str(volume.path) in (waiting["reason"] or "") + json.dumps(waiting["held"]), waiting
            assert set(waiting["holds"]) & {"extract", "train"} and shown["paused"], waiting
            time.sleep(2)
            assert (held := status())["state"] == "training" and held["stages"]["extract"]["failed"] == 0, held

            neighbour.unlink()  # the neighbour's file goes; nobody touches the run
            final = wait_settled(stack, ONLINE_RUN, 300)

        assert final["state"] == "complete", final
        assert final["disk"]["held"] == {} and final["disk"]["paused"] is False
        plan = json.loads(paths.online_plan.read_text())
        log = [json.loads(line) for line in paths.train_log.read_text().splitlines()]
        assert [record["step"] for record in log] == list(range(1, len(log) + 1))  # each step once, no torn line
        for epoch in range(ONLINE_EPOCHS):
            assert sorted(i for r in log if r["epoch"] == epoch for i in r["samples"]) == sorted(plan["train_ids"])
        left = landed_files(paths)
        assert sorted(int(p.stem) for p in left) == sorted(plan["validation_ids"])
        assert temp_files(paths.root) == []
        assert final["online"]["spool_files"] == len(left)
        assert final["online"]["spool_bytes"] == sum(p.stat().st_size for p in left)
