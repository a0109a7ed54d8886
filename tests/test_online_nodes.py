"""Online training across two hosts, as real processes. Host A is this machine: Redis on its bridge address and
the stack (inference server, controller, generator, extractors, and a trainer whose train jobs are node 0 of
two, hosting the rendezvous). Host B is a network namespace: ``draftline serve trainer`` with
``DRAFTLINE_TRAIN_NODE=join``, reaching Redis and the rendezvous over the network only and the volume through the
shared filesystem. The online run trains one rank on each host, each its disjoint share of every global batch,
on states extracted as rank 0 asks for them within the budget: every sample trains once per epoch, and only the
held-out files stay."""

from __future__ import annotations

import json
import time
from collections import Counter
from contextlib import ExitStack

import httpx
import pytest

from runtime.runstate import finished_path
from services.cli.stack import LocalStack, StackConfig
from shared.atomic import temp_files
from shared.layout import RunPaths
from tests.support.netns import kill_group, wait_for_line
from tests.support.processes import free_port
from tests.test_pipeline import write_dataset
from tests.test_worker_host_down import TOKEN, host_beside_with_redis, serve, status

pytestmark = [pytest.mark.slow, pytest.mark.online, pytest.mark.multinode]

RUN = "online-nodes"
EPOCHS = 2
TIMEOUT_S = "120"  # the rendezvous join and collective timeout both nodes run with
FINISH_S = 420


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("online-nodes")
    logs, data, dataset = root / "logs", root / "data", root / "prompts.jsonl"
    logs.mkdir()
    write_dataset(dataset, rows=40)
    with ExitStack() as cleanup:
        here, there, redis_url = host_beside_with_redis(cleanup, root, "dlon", 150)
        node = {"DRAFTLINE_DEVICE": "cpu", "DRAFTLINE_TRAIN_PROCS": "1", "DRAFTLINE_TRAIN_TIMEOUT_S": TIMEOUT_S}
        joiner_env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data), "DRAFTLINE_MODEL_DIR": str(tiny_model_dir),
                      "DRAFTLINE_TRAIN_NODE": "join", "DRAFTLINE_TRAIN_NODE_ADDR": there.addr,
                      "GLOO_SOCKET_IFNAME": there.ifname, **node}
        joiner, joiner_log = serve(there, "trainer", joiner_env, logs)
        cleanup.callback(kill_group, joiner)
        wait_for_line(joiner_log, "waiting for a multi-node training to join", 60, joiner)
        job_host = {"DRAFTLINE_TRAIN_NODES": "2", "DRAFTLINE_TRAIN_RDZV_ENDPOINT": f"{here.addr}:{free_port()}",
                    "DRAFTLINE_TRAIN_NODE_ADDR": here.addr, "GLOO_SOCKET_IFNAME": here.ifname, **node}
        config = StackConfig(data=data, model_dir=tiny_model_dir, log_dir=logs, redis_url=redis_url,
                             replicas={"generator": 1, "extractor": 2}, host=here.addr, api_token=TOKEN,
                             env={"DRAFTLINE_DATASET_ROOTS": str(root), **job_host})
        with LocalStack(config) as stack:
            body = {
                "dataset": str(dataset), "name": RUN,
                "generation": {"max_tokens": 24, "min_completion_tokens": 4},
                "train": {"epochs": EPOCHS, "global_batch_size": 4, "lr": 2e-3, "ttt_steps": 2,
                          "draft_vocab_size": 128, "max_length": 128, "save_every": 3, "validation_files": 2},
                "evaluate": {"holdout": 4, "max_new_tokens": 8, "draft_steps": 2, "sets": ["holdout"],
                             "curve_max_steps": 2},
                "online": {"enabled": True, "budget_bytes": 500_000, "vocab_files": 8},
            }
            response = httpx.post(f"{stack.url('controller')}/runs", json=body, timeout=60,
                                  headers={"Authorization": f"Bearer {TOKEN}"})
            assert response.status_code == 201, response.text
            paths = RunPaths(data, RUN)
            deadline = time.monotonic() + FINISH_S
            while not ((final := status(stack, RUN)) and final["state"] in ("complete", "complete_with_failures", "failed")
                       and finished_path(paths).exists()):
                assert time.monotonic() < deadline, f"not settled in {FINISH_S}s: {final}"
                stack.check_alive()
                assert joiner.poll() is None, joiner_log.read_text(errors="replace")[-3000:]
                time.sleep(1)
        yield {"status": final, "data": data, "joiner_log": joiner_log.read_text(errors="replace"), "logs": logs}


def test_an_online_run_trains_on_two_hosts_each_sample_once_per_epoch(two_node_run):
    final, paths = two_node_run["status"], RunPaths(two_node_run["data"], RUN)
    assert final["state"] in ("complete", "complete_with_failures"), (final, two_node_run["logs"])
    assert final["stages"]["extract"]["failed"] == 0  # the failures are the dataset's bad rows (write_dataset)
    joined = two_node_run["joiner_log"]
    assert f"run {RUN}: joining training {RUN}-" in joined and "finished on this node" in joined, joined[-3000:]
    checkpoints = sorted(paths.checkpoints_dir.glob("step_*"))
    assert checkpoints and json.loads((checkpoints[-1] / "state.json").read_text())["world_size"] == 2
    plan = json.loads(paths.online_plan.read_text())
    log = [json.loads(line) for line in paths.train_log.read_text().splitlines()]
    assert [record["step"] for record in log] == list(range(1, len(log) + 1))
    for epoch in range(EPOCHS):
        trained = Counter(i for record in log if record["epoch"] == epoch for i in record["samples"])
        assert trained == Counter(plan["train_ids"]), epoch
    left = sorted(int(p.stem) for p in paths.hidden_dir.rglob("*.safetensors"))
    assert left == sorted(plan["validation_ids"]) and temp_files(paths.root) == []
    assert final["online"]["spool_files"] == len(left)
