"""An online run as real processes (Redis, inference server, controller, RQ workers, trainer): it trains while
extracting, its hidden states never outgrow the budget, each sample trains once per epoch, and the files go once
the checkpoints hold them."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from services.cli.stack import LocalStack, StackConfig
from shared.atomic import temp_files
from shared.layout import RunPaths
from tests.support.runs import wait_terminal
from tests.test_pipeline import write_dataset

pytestmark = [pytest.mark.slow, pytest.mark.online]

RUN = "online"
EPOCHS = 2
VALIDATION = 2
BATCH = 4  # train.batch_size, one process
BUDGET = 500_000  # bytes: under a third of the run's states (each file some 50 KB), fewer files than a checkpoint's steps read


class BytesSampler(threading.Thread):
    """The bytes of every hidden-state file of a run on the volume, summed every ``every_s`` seconds: the peak,
    and the largest file seen."""

    def __init__(self, directory: Path, every_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.directory, self.every_s = directory, every_s
        self.peak = self.largest = self.samples = 0
        self.at_peak: tuple[float, list] = (0.0, [])  # when, and the files then
        self.sizes: dict[str, int] = {}  # each sample's file as last seen: what keeping them all would hold
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            sizes = []
            for path in self.directory.rglob("*.safetensors") if self.directory.is_dir() else ():
                try:
                    sizes.append(path.stat().st_size)
                except FileNotFoundError:
                    continue
                self.sizes[path.name] = sizes[-1]
            if sum(sizes) > self.peak:
                self.peak, self.at_peak = sum(sizes), (time.time(), sorted(self.sizes_now(sizes)))
            self.samples += 1
            self.largest = max([self.largest, *sizes])
            self.stopped.wait(self.every_s)

    def sizes_now(self, sizes: list[int]) -> list[str]:
        return [p.name for p in self.directory.rglob("*.safetensors")]

    def stop(self) -> BytesSampler:
        self.stopped.set()
        self.join(timeout=10)
        return self


@pytest.fixture(scope="module")
def online_run(tmp_path_factory, redis_server, tiny_model_dir):
    root = tmp_path_factory.mktemp("online")
    data, dataset = root / "data", root / "prompts.jsonl"
    write_dataset(dataset, rows=44)
    config = StackConfig(data=data, model_dir=tiny_model_dir, log_dir=root / "logs", redis_url=redis_server.url,
                         env={"DRAFTLINE_DATASET_ROOTS": str(root)}, replicas={"generator": 1, "extractor": 2})
    sampler = BytesSampler(RunPaths(data, RUN).hidden_dir)
    with LocalStack(config) as stack:
        body = {
            "dataset": str(dataset), "name": RUN,
            "generation": {"max_tokens": 24, "min_completion_tokens": 4},
            "train": {"epochs": EPOCHS, "batch_size": BATCH, "lr": 2e-3, "ttt_steps": 2, "draft_vocab_size": 128,
                      "max_length": 128, "save_every": 3, "validation_files": VALIDATION},
            "evaluate": {"holdout": 4, "max_new_tokens": 16, "draft_steps": 2, "humaneval_limit": 2,
                         "curve_max_steps": 2},
            "online": {"enabled": True, "budget_bytes": BUDGET, "vocab_files": 8},
        }
        sampler.start()
        response = httpx.post(f"{stack.url('controller')}/runs", json=body, timeout=60)
        assert response.status_code == 201, response.text
        status = wait_terminal(stack, RUN, timeout=420.0)
    return {"status": status, "data": data, "spec": response.json(), "sampler": sampler.stop(),
            "trainer_log": (root / "logs" / "trainer-0.log").read_text()}


def train_log(data: Path) -> list[dict]:
    return [json.loads(line) for line in RunPaths(data, RUN).train_log.read_text().splitlines()]


def test_the_online_run_completes_and_exports(online_run):
    from modeling.export import verify_export

    status = online_run["status"]
    assert status["state"] in ("complete", "complete_with_failures"), status
    verify_export(RunPaths(online_run["data"], RUN).export_dir)
    assert online_run["spec"]["online"] == {"enabled": True, "budget_bytes": BUDGET, "vocab_files": 8}


def test_every_sample_trains_exactly_once_per_epoch(online_run):
    data = online_run["data"]
    plan = json.loads(RunPaths(data, RUN).online_plan.read_text())
    expected = Counter(plan["train_ids"])
    assert len(expected) > 20 and len(plan["validation_ids"]) == VALIDATION
    assert not set(plan["validation_ids"]) & set(expected)
    for epoch in range(EPOCHS):
        trained = Counter(i for record in train_log(data) if record["epoch"] == epoch for i in record["samples"])
        assert trained == expected, epoch


def test_the_spool_never_outgrew_its_budget_by_more_than_one_file(online_run):
    sampler = online_run["sampler"]
    assert sampler.samples > 20 and sampler.largest > 0
    assert 0 < sampler.peak <= BUDGET + sampler.largest, sampler.at_peak
    assert 3 * BUDGET < sum(sampler.sizes.values())  # what an offline run keeps till training ends


def test_only_the_held_out_files_stay_and_the_counts_equal_the_volume(online_run):
    data, status = online_run["data"], online_run["status"]
    paths = RunPaths(data, RUN)
    plan = json.loads(paths.online_plan.read_text())
    left = sorted(int(p.stem) for p in paths.hidden_dir.rglob("*.safetensors"))
    assert left == sorted(plan["validation_ids"])
    assert temp_files(paths.root) == []
    online = status["online"]
    assert online["spool_files"] == len(left)
    assert online["spool_bytes"] == sum(p.stat().st_size for p in paths.hidden_dir.rglob("*.safetensors"))
    assert online["released"] >= len(plan["train_ids"])  # every training file went at least once
    assert 0 < online["peak_bytes"] <= online["budget_bytes"] + online_run["sampler"].largest
    assert online["epoch"] == EPOCHS - 1 and online["epoch_trained"] == len(plan["train_ids"])
    assert 0 <= online["train_wait_fraction"] <= 1 and online["bottleneck"] in ("extraction", "training")


def test_the_plan_knew_each_files_length_before_it_was_extracted(online_run):
    from shared.manifest import read_manifest

    paths = RunPaths(online_run["data"], RUN)
    plan = json.loads(paths.online_plan.read_text())
    landed = {}
    for manifest in paths.hidden_dir.rglob("manifest.jsonl"):
        landed.update({i: entry.num_tokens for i, entry in read_manifest(manifest).items()})
    assert {i: landed[i] for i in plan["train_ids"]} == dict(zip(plan["train_ids"], plan["tokens"]))


def test_files_go_after_their_step_so_checkpoints_keep_their_cadence_and_nothing_is_deleted_unread(online_run):
    import re

    log = train_log(online_run["data"])
    saved = [int(step) for step in re.findall(r"step (\d+): checkpoint", online_run["trainer_log"])]
    total = log[-1]["step"]
    assert saved == [step for step in range(1, total + 1) if step % 3 == 0 or step == total]  # save_every 3 alone
    online = online_run["status"]["online"]
    assert online["evicted"] == 0
    assert online["window_limit"] in ("budget", "rates", "end") and online["window_files"] >= 0
