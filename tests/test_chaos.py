"""Chaos: a 300-sample run survives SIGKILLed workers, a killed inference server and a Redis restart
without persistence — every expected id ends verified exactly once, with no temp files, and the
counters agree with the volume. An online run beside it trains through the same faults and a SIGKILLed
trainer: each sample trained once per epoch, only its held-out files left, its spool's counts the volume's.

Bounded in time and in the number of faults; loopback only; the Redis server is the test's own.
"""

from __future__ import annotations

import json
import random
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import redis

from services.cli.demo import demo_prompts_path
from services.cli.stack import LocalStack, StackConfig
from runtime.runstate import RunState, finished_path
from shared.atomic import temp_files
from shared.hidden_file import verify_hidden_file
from shared.layout import RunPaths
from shared.manifest import MANIFEST_NAME, read_manifest
from tests.support.acceptance import assert_report_matches, expected_report_of_run
from tests.support.processes import RedisServer
from tests.support.runs import status_or_none

pytestmark = pytest.mark.slow

RUN = "chaos"
ROWS = 304
HOLDOUT = 4
DECODING = {"max_new_tokens": 8, "draft_steps": 2}  # the run's evaluation settings
HOLDOUT_ONLY = {"sets": ["holdout"], "curve_max_steps": 2}  # evaluation kept short: the run's survival is the point
FAULTS = 14
CHAOS_SECONDS = 150
FINISH_SECONDS = 420
WORKERS = ("generator", "extractor")
ONLINE_RUN = "chaos-online"  # submitted first: it trains (extracting as it goes) while the big run generates
ONLINE_ROWS = 48
ONLINE_EPOCHS = 2
# The faults must land while the sample stages run: on their own they finish in about 15 s here, before
# half the planned faults. One request in flight per generator, each waiting 400 ms for a batch to fill,
# keeps generation (and the extraction that follows each reply) going long enough for all 14.
PACE = {"DRAFTLINE_CONCURRENCY": "1", "DRAFTLINE_BATCH_WAIT_MS": "400"}


def write_dataset(path: Path) -> None:
    good = demo_prompts_path().read_text().splitlines()
    path.write_text("\n".join(good[i % len(good)] for i in range(ROWS)) + "\n")


def status(stack: LocalStack, run: str = RUN) -> dict | None:
    return status_or_none(stack, run)


def respawn_dead(stack: LocalStack) -> None:
    for proc in list(stack.procs):
        if proc.popen.poll() is not None:
            index = stack.processes(proc.name).index(proc.popen)
            stack.respawn(proc.name, index)


def fault_plan(rng: random.Random) -> list[str]:
    """Every kind of fault at least once (Redis exactly once, mid-run), the rest worker kills."""
    plan = ["kill-generator", "kill-extractor", "inference", "kill-trainer", "kill-generator", "kill-extractor",
            "inference", "kill-trainer"]
    plan += [rng.choice(["kill-generator", "kill-extractor", "inference", "kill-trainer"])
             for _ in range(FAULTS - len(plan) - 1)]
    rng.shuffle(plan)
    plan.insert(len(plan) // 3, "redis")
    return plan


def inject(stack: LocalStack, redis_server: RedisServer, rng: random.Random, fault: str) -> None:
    if fault.startswith("kill-"):
        name = fault.removeprefix("kill-")
        index = rng.randrange(len(stack.processes(name)))
        stack.kill(name, index, signal.SIGKILL)
        time.sleep(0.5)
        stack.respawn(name, index)
    elif fault == "inference":
        stack.kill("inference", 0, signal.SIGKILL)
        time.sleep(rng.uniform(1.0, 4.0))  # workers meet a dead server meanwhile
        stack.respawn("inference", 0)
    else:
        redis_server.stop()
        time.sleep(1.0)
        redis_server.start()  # same port, empty: no persistence


def inject_faults(stack: LocalStack, redis_server: RedisServer, rng: random.Random) -> list[str]:
    """The planned faults, one every few seconds, while the sample stages still run."""
    done: list[str] = []
    deadline = time.monotonic() + CHAOS_SECONDS
    for fault in fault_plan(rng):
        if time.monotonic() > deadline:
            break
        time.sleep(rng.uniform(1.5, 4.0))
        current, online = status(stack), status(stack, ONLINE_RUN)
        if current is not None and current["state"] not in ("queued", "generating", "extracting") \
                and online is not None and online["state"] not in ("queued", "generating", "extracting", "training"):
            break
        inject(stack, redis_server, rng, fault)
        done.append(fault)
        respawn_dead(stack)
    return done


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("chaos")
    redis_server = RedisServer(root / "redis").start()
    data = root / "data"
    dataset = root / "prompts.jsonl"
    write_dataset(dataset)
    config = StackConfig(
        data=data, model_dir=tiny_model_dir, log_dir=root / "logs", redis_url=redis_server.url,
        replicas={"generator": 2, "extractor": 2}, env={"DRAFTLINE_DATASET_ROOTS": str(root), **PACE},
    )
    rng = random.Random(20261129)
    try:
        with LocalStack(config) as stack:
            online = {
                "dataset": str(dataset), "name": ONLINE_RUN, "limit": ONLINE_ROWS,
                "generation": {"max_tokens": 12, "min_completion_tokens": 2},
                "train": {"epochs": ONLINE_EPOCHS, "batch_size": 4, "ttt_steps": 2, "draft_vocab_size": 128,
                          "max_length": 96, "save_every": 3, "validation_files": 2},
                "evaluate": {"holdout": HOLDOUT, **DECODING, **HOLDOUT_ONLY},
                "online": {"enabled": True, "budget_bytes": 300_000, "vocab_files": 6},
            }
            response = httpx.post(f"{stack.url('controller')}/runs", json=online, timeout=60)
            assert response.status_code == 201, response.text
            body = {
                "dataset": str(dataset), "name": RUN,
                "generation": {"max_tokens": 12, "min_completion_tokens": 0},
                "train": {"epochs": 1, "batch_size": 16, "ttt_steps": 2, "draft_vocab_size": 128, "max_length": 96},
                "evaluate": {"holdout": HOLDOUT, **DECODING, **HOLDOUT_ONLY},
            }
            response = httpx.post(f"{stack.url('controller')}/runs", json=body, timeout=60)
            assert response.status_code == 201, response.text
            faults = inject_faults(stack, redis_server, rng)
            deadline = time.monotonic() + FINISH_SECONDS
            final = None
            while time.monotonic() < deadline:
                respawn_dead(stack)
                final = status(stack)
                online_final = status(stack, ONLINE_RUN)
                # the supervisor's final sweep of each is done
                finished = all(finished_path(RunPaths(data, run)).exists() for run in (RUN, ONLINE_RUN))
                if final and online_final and finished and all(
                        one["state"] in ("complete", "complete_with_failures", "failed") for one in (final, online_final)):
                    break
                time.sleep(1)
            conn = redis.Redis.from_url(redis_server.url)
            counts = {stage: RunState(conn, data, RUN).counts(stage) for stage in ("generate", "extract")}
        yield {"status": final, "online": online_final, "faults": faults, "data": data, "counts": counts, "logs": root / "logs",
               "model_dir": tiny_model_dir}
    finally:
        redis_server.stop()


def test_faults_were_injected(chaos_run):
    faults = chaos_run["faults"]
    assert len(faults) >= 8, faults
    assert {"kill-generator", "kill-extractor", "inference", "kill-trainer", "redis"} <= set(faults), faults


def test_run_completes_despite_the_faults(chaos_run):
    final = chaos_run["status"]
    assert final is not None and final["state"] == "complete", (final, chaos_run["logs"])


def test_every_expected_id_is_verified_exactly_once(chaos_run):
    paths = RunPaths(chaos_run["data"], RUN)
    expected = set(range(ROWS - HOLDOUT))
    files = sorted(paths.hidden_dir.rglob("*.safetensors"))
    ids = [int(p.stem) for p in files]
    assert len(ids) == len(set(ids))  # no duplicates
    assert set(ids) == expected
    manifests = {}
    for shard in {p.parent for p in files}:
        manifests.update(read_manifest(shard / MANIFEST_NAME))
    for path, sample_id in zip(files, ids):
        verify_hidden_file(path, layer_ids=[1, 3, 4], sha256=manifests[sample_id].sha256)
    generated = {int(p.stem) for p in paths.generated_dir.rglob("*.json")}
    assert generated == expected


def test_no_temp_files_and_counters_agree_with_the_volume(chaos_run):
    paths = RunPaths(chaos_run["data"], RUN)
    assert temp_files(paths.root) == []
    counts = chaos_run["counts"]
    on_volume = len(list(paths.hidden_dir.rglob("*.safetensors")))
    assert counts["extract"].done == on_volume == ROWS - HOLDOUT
    assert counts["generate"].done == len(list(paths.generated_dir.rglob("*.json")))
    assert counts["extract"].failed == counts["generate"].failed == 0
    report = json.loads(paths.eval_report.read_text())
    assert_report_matches(report, expected_report_of_run(chaos_run["model_dir"], paths.export_dir, paths.eval_prompts,
                                                         **DECODING))


def test_the_online_run_beside_it_trains_each_sample_once_per_epoch_through_the_faults(chaos_run):
    online = chaos_run["online"]
    assert online is not None and online["state"] == "complete", (online, chaos_run["logs"])
    paths = RunPaths(chaos_run["data"], ONLINE_RUN)
    plan = json.loads(paths.online_plan.read_text())
    assert len(plan["train_ids"]) + len(plan["validation_ids"]) == ONLINE_ROWS - HOLDOUT
    log = [json.loads(line) for line in paths.train_log.read_text().splitlines()]
    assert [record["step"] for record in log] == list(range(1, len(log) + 1))  # a resumed log holds each step once
    for epoch in range(ONLINE_EPOCHS):
        trained = Counter(i for record in log if record["epoch"] == epoch for i in record["samples"])
        assert trained == Counter(plan["train_ids"]), epoch
    left = sorted(paths.hidden_dir.rglob("*.safetensors"))
    assert sorted(int(p.stem) for p in left) == sorted(plan["validation_ids"])
    for path in left:
        verify_hidden_file(path)
    assert temp_files(paths.root) == []
    assert online["online"]["spool_files"] == len(left)
    assert online["online"]["spool_bytes"] == sum(p.stat().st_size for p in left)
