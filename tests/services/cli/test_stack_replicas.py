"""A LocalStack with two inference servers: both start healthy on their own ports, every service is given
both in its endpoint lists, a run's requests reach both, and one replica is killed and respawned alone.

Real processes (the commands docker-compose.yml runs) on the tiny target, as tests/test_pipeline.py runs them.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.cli.demo import demo_prompts_path
from services.cli.stack import LocalStack, StackConfig, StackError
from tests.support.runs import wait_terminal

pytestmark = pytest.mark.slow

RUN = "replicas"
PROMPTS = 8
HOLDOUT = 2
CHAT = "/v1/chat/completions"
HIDDEN = "/v1/hidden_states"


def write_dataset(path: Path, rows: int) -> None:
    good = demo_prompts_path().read_text().splitlines()
    path.write_text("\n".join(good[i % len(good)] for i in range(rows)) + "\n")


def answered(base_url: str) -> dict[str, float]:
    """Requests a server answered with 200, by route, from its /metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "draftline_inference_requests_total" and sample.labels.get("status") == "200":
                counts[sample.labels["endpoint"]] = counts.get(sample.labels["endpoint"], 0) + sample.value
    return counts


def environ(pid: int) -> dict[str, str]:
    """The environment a running process was started with, as the kernel holds it."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.split("=", 1) for entry in raw.decode().split("\0") if "=" in entry)


@pytest.fixture(scope="module")
def stack_with_run(tmp_path_factory, redis_server, tiny_model_dir):
    root = tmp_path_factory.mktemp("replicas")
    dataset = root / "prompts.jsonl"
    write_dataset(dataset, PROMPTS + HOLDOUT)
    config = StackConfig(data=root / "data", model_dir=tiny_model_dir, log_dir=root / "logs",
                         redis_url=redis_server.url, replicas={"inference": 2, "generator": 1, "extractor": 1},
                         env={"DRAFTLINE_DATASET_ROOTS": str(root)})
    with LocalStack(config) as stack:
        body = {
            "dataset": str(dataset), "name": RUN,
            "generation": {"max_tokens": 12, "min_completion_tokens": 1},
            "train": {"epochs": 1, "batch_size": 8, "ttt_steps": 2, "draft_vocab_size": 128, "max_length": 96},
            "evaluate": {"holdout": HOLDOUT, "max_new_tokens": 8, "draft_steps": 2, "sets": ["holdout"],
                         "curve_max_steps": 2},
        }
        response = httpx.post(f"{stack.url('controller')}/runs", json=body, timeout=60)
        assert response.status_code == 201, response.text
        status = wait_terminal(stack, RUN, timeout=420.0)
        yield stack, status


def test_both_inference_replicas_are_healthy_on_their_own_ports(stack_with_run):
    stack, _ = stack_with_run
    urls = stack.urls("inference")
    assert len(urls) == len(set(urls)) == 2
    assert stack.url("inference") == urls[0]
    for url in urls:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert [path.name for path in stack.log_paths("inference")] == ["inference-0.log", "inference-1.log"]


def test_every_service_is_given_both_servers(stack_with_run):
    stack, _ = stack_with_run
    both = ",".join(stack.urls("inference"))
    for name in ("generator", "extractor", "controller"):
        env = environ(stack.processes(name)[0].pid)
        assert env["DRAFTLINE_INFERENCE_URL"] == env["DRAFTLINE_HIDDEN_STATES_URL"] == both, name
    # The controller's preflight asked both and found the same model on each.
    report = httpx.get(f"{stack.url('controller')}/preflight", timeout=60).json()
    check = next(c for c in report["checks"] if c["name"] == "inference server")
    assert check["ok"], check
    assert all(url in check["message"] for url in stack.urls("inference")), check["message"]


def test_the_run_completes_with_requests_on_both_servers(stack_with_run):
    stack, status = stack_with_run
    assert status["state"] == "complete", json.dumps(status)[:3000]
    assert status["stages"]["generate"]["done"] == status["stages"]["extract"]["done"] == PROMPTS
    counts = [answered(url) for url in stack.urls("inference")]
    for replica, count in enumerate(counts):
        assert count.get(CHAT, 0) > 0 and count.get(HIDDEN, 0) > 0, (replica, counts)
    assert sum(c.get(HIDDEN, 0) for c in counts) >= PROMPTS


def test_one_replica_is_killed_and_respawned_on_its_port(stack_with_run):
    stack, _ = stack_with_run
    before = stack.urls("inference")
    first_pid = stack.processes("inference")[0].pid
    stack.kill("inference", 1, signal.SIGKILL)
    stack.processes("inference")[1].wait(30)
    stack.check_alive("inference", 0)
    with pytest.raises(StackError, match=r"inference \(replica 1\)"):
        stack.check_alive("inference")
    stack.respawn("inference", 1)
    stack.check_alive()
    assert stack.urls("inference") == before
    assert stack.processes("inference")[0].pid == first_pid
    assert httpx.get(f"{before[1]}/health", timeout=10).status_code == 200
