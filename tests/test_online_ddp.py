"""Online training with the other drafter method across two training processes, as real processes: a DFlash
drafter trained by two torchrun ranks (each its share of every global batch, as offline) on states extracted as
rank 0 asks for them within the budget. Every sample trains once per epoch and the export verifies."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest

from services.cli.stack import LocalStack, StackConfig
from shared.layout import RunPaths
from tests.support.runs import wait_terminal
from tests.test_pipeline import write_dataset

pytestmark = [pytest.mark.slow, pytest.mark.online, pytest.mark.dflash]

RUN = "online-ddp"
EPOCHS = 2


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, redis_server, tiny_model_dir):
    root = tmp_path_factory.mktemp("online-ddp")
    data, dataset = root / "data", root / "prompts.jsonl"
    write_dataset(dataset, rows=36)
    redis_server_flush(redis_server)
    config = StackConfig(data=data, model_dir=tiny_model_dir, log_dir=root / "logs", redis_url=redis_server.url,
                         env={"DRAFTLINE_DATASET_ROOTS": str(root), "DRAFTLINE_TRAIN_PROCS": "2"},
                         replicas={"generator": 1, "extractor": 2})
    with LocalStack(config) as stack:
        body = {
            "dataset": str(dataset), "name": RUN,
            "generation": {"max_tokens": 24, "min_completion_tokens": 4},
            "train": {"method": "dflash", "dflash": {"block_size": 4, "layers": 1, "anchors": 8}, "epochs": EPOCHS,
                      "global_batch_size": 4, "lr": 2e-3, "draft_vocab_size": 128, "max_length": 128,
                      "save_every": 3},
            "evaluate": {"holdout": 4, "max_new_tokens": 8, "draft_steps": 3, "sets": ["holdout"],
                         "curve_max_steps": 3},
            "online": {"enabled": True, "budget_bytes": 500_000, "vocab_files": 8},
        }
        response = httpx.post(f"{stack.url('controller')}/runs", json=body, timeout=60)
        assert response.status_code == 201, response.text
        status = wait_terminal(stack, RUN, timeout=420.0)
    return {"status": status, "data": data}


def redis_server_flush(redis_server) -> None:
    import redis

    redis.Redis.from_url(redis_server.url).flushall()  # jobs other tests left would be taken by this stack's workers


def test_two_ranks_train_a_dflash_drafter_online_each_sample_once_per_epoch(ddp_run):
    from modeling.dflash_export import verify_dflash_export

    status, data = ddp_run["status"], ddp_run["data"]
    assert status["state"] in ("complete", "complete_with_failures"), status
    paths = RunPaths(data, RUN)
    verify_dflash_export(paths.export_dir)
    plan = json.loads(paths.online_plan.read_text())
    log = [json.loads(line) for line in paths.train_log.read_text().splitlines()]
    for epoch in range(EPOCHS):
        trained = Counter(i for record in log if record["epoch"] == epoch for i in record["samples"])
        assert trained == Counter(plan["train_ids"]), epoch
    assert status["stages"]["train"]["total"] == EPOCHS * -(-len(plan["train_ids"]) // 4)
    assert json.loads(paths.online_plan.read_text())["facts"]["mask_token_id"] >= 0  # chosen once, kept for resumes
    assert sorted(p.stem for p in paths.hidden_dir.rglob("*.safetensors")) == []  # no file held out: none stays
