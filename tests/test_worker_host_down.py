"""Workers on another host, reached over the network, and that host lost mid-run.

Host A is this machine: Redis (with a password) and the stack (inference server, controller, exporter, trainer),
listening on A's address on a veth pair. Host B is a network namespace on the other end of the pair: its
generator and extractor reach Redis and the inference server over that address only, and write to the volume
through the shared filesystem, as a second machine with the volume mounted over NFS does. While the sample
stages run, B goes down as a machine does when it loses power: the pair is cut first (B's sockets get no FIN
or reset), then everything in B is killed and the namespace deleted. Host A's own workers, started afterwards,
finish the run: every expected sample ends verified exactly once, nothing is named failed, and the run
completes through training and evaluation.
"""

from __future__ import annotations

import os
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import redis

from services.cli.demo import demo_prompts_path
from services.cli.stack import LocalStack, StackConfig, resolve_command
from runtime.runstate import RunState, finished_path
from shared.atomic import temp_files
from shared.hidden_file import verify_hidden_file
from shared.layout import RunPaths
from shared.manifest import MANIFEST_NAME, read_manifest
from shared.jobs import GENERATE_QUEUE
from runtime.queues import queue
from shared.services import SERVICE_COMMANDS
from tests.support.netns import Host, NamespacesUnavailable, cut, host_beside_this_machine, kill_group, wait_for_line
from tests.support.processes import free_port

pytestmark = [pytest.mark.slow, pytest.mark.multinode]

RUN = "host-down"
ROWS, HOLDOUT = 40, 2
PASSWORD = "host-down-pw"
TOKEN = "host-down-test-token-0123"  # the controller listens on a non-loopback address, so it needs one
# One request in flight and 400 ms for a batch to fill: host B's generator takes about half a second a sample,
# so the sample stages are still running when B goes down after its first few extracted samples.
PACE = {"DRAFTLINE_CONCURRENCY": "1", "DRAFTLINE_BATCH_WAIT_MS": "400"}
DOWN_AFTER_EXTRACTED = 4
FINISH_S = 420


def write_dataset(path: Path) -> None:
    good = demo_prompts_path().read_text().splitlines()
    path.write_text("\n".join(good[i % len(good)] for i in range(ROWS)) + "\n")


def status(stack: LocalStack, run: str = RUN) -> dict | None:
    try:
        response = httpx.get(f"{stack.url('controller')}/runs/{run}", timeout=10,
                             headers={"Authorization": f"Bearer {TOKEN}"})
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def serve(host: Host, name: str, env: dict[str, str], logs: Path) -> tuple[subprocess.Popen, Path]:
    """``draftline serve NAME`` on ``host`` with only ``env`` (and PATH, HOME) in its environment."""
    log = logs / f"{name}-{'a' if host.name is None else host.name}.log"
    full = {"PATH": os.environ["PATH"], "HOME": str(logs), "PYTHONUNBUFFERED": "1", **env}
    return host.popen(resolve_command(SERVICE_COMMANDS[name]), log, full), log


def start_redis(here: Host, root: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = root / "redis.log"
    proc = here.popen(["redis-server", "--bind", here.addr, "127.0.0.1", "--port", str(port), "--requirepass",
                       PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(root)], log, os.environ)
    wait_for_line(log, "Ready to accept connections", 30, proc)
    return proc, f"redis://:{PASSWORD}@{here.addr}:{port}/0"


def host_beside_with_redis(cleanup: ExitStack, root: Path, tag: str, subnet: int) -> tuple[Host, Host, str]:
    """This machine and a namespaced host beside it (``tag`` and ``subnet`` made unique by the process id), with
    Redis on this machine's address; all undone by ``cleanup``."""
    try:
        here, there = cleanup.enter_context(host_beside_this_machine(f"{tag}{os.getpid() % 10000}",
                                                                     subnet + os.getpid() % 50))
    except NamespacesUnavailable as exc:  # the reason is the failure: these tests never skip
        pytest.fail(f"cannot make a namespaced host here: {exc}")
    redis_proc, redis_url = start_redis(here, root)
    cleanup.callback(kill_group, redis_proc)
    return here, there, redis_url


def wait_for(predicate, what: str, timeout_s: float, stack: LocalStack, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stack.check_alive()
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f}s (last status: {status(stack)})")


def ns_alive(name: str) -> bool:
    return name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def take_down(here: Host, there: Host, procs: list[subprocess.Popen]) -> None:
    """Host B loses power: its link first, so its open connections just stop, then its processes."""
    cut(there)
    for proc in procs:
        kill_group(proc)
    subprocess.run(["ip", "netns", "del", there.name], capture_output=True, check=True)


@pytest.fixture(scope="module")
def host_down_run(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("host-down")
    logs = root / "logs"
    logs.mkdir()
    data = root / "data"
    dataset = root / "prompts.jsonl"
    write_dataset(dataset)
    with ExitStack() as cleanup:
        here, there, redis_url = host_beside_with_redis(cleanup, root, "dlhd", 200)
        config = StackConfig(data=data, model_dir=tiny_model_dir, log_dir=logs, redis_url=redis_url,
                             replicas={"generator": 0, "extractor": 0}, host=here.addr, api_token=TOKEN,
                             env={"DRAFTLINE_DATASET_ROOTS": str(root), **PACE})
        with LocalStack(config) as stack:
            worker_env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data), "DRAFTLINE_MODEL_DIR": str(tiny_model_dir),
                          "DRAFTLINE_INFERENCE_URL": stack.url("inference"),
                          "DRAFTLINE_HIDDEN_STATES_URL": stack.url("inference"), **PACE}
            body = {"dataset": str(dataset), "name": RUN, "generation": {"max_tokens": 12, "min_completion_tokens": 0},
                    "train": {"epochs": 1, "batch_size": 16, "ttt_steps": 2, "draft_vocab_size": 128, "max_length": 96},
                    "evaluate": {"holdout": HOLDOUT, "max_new_tokens": 8, "draft_steps": 2, "sets": ["holdout"],
                                 "curve_max_steps": 2}}
            response = httpx.post(f"{stack.url('controller')}/runs", json=body, timeout=60,
                                  headers={"Authorization": f"Bearer {TOKEN}"})
            assert response.status_code == 201, response.text

            on_b = [serve(there, name, worker_env, logs) for name in ("generator", "extractor")]
            for proc, _ in on_b:
                cleanup.callback(kill_group, proc)
            # Down while B's generator holds a started job (only B's workers run yet), so that the job must
            # come back through the reaper.
            generating = queue(GENERATE_QUEUE, redis.Redis.from_url(redis_url))
            at_down = wait_for(lambda: (s := status(stack)) and s["stages"]["extract"]["done"] >= DOWN_AFTER_EXTRACTED
                               and generating.started_job_registry.count > 0 and s,
                               f"{DOWN_AFTER_EXTRACTED} samples extracted by host B, a generate job started", 180, stack)
            take_down(here, there, [proc for proc, _ in on_b])
            b_logs = [log.read_text(errors="replace") for _, log in on_b]

            on_a = [serve(here, name, worker_env, logs) for name in ("generator", "extractor")]
            for proc, _ in on_a:
                cleanup.callback(kill_group, proc)
            paths = RunPaths(data, RUN)
            final = wait_for(lambda: (s := status(stack)) and s["state"].startswith("complete")
                             and finished_path(paths).exists() and s, "run complete", FINISH_S, stack, poll_s=1)
            a_alive = [proc.poll() is None for proc, _ in on_a]
            conn = redis.Redis.from_url(redis_url)
            counts = {stage: RunState(conn, data, RUN).counts(stage) for stage in ("generate", "extract")}
            # Host A's workers are killed by the cleanup: how a worker stops is tests/runtime/test_worker.py's
            # subject, not this test's.
        yield {"at_down": at_down, "final": final, "counts": counts, "data": data, "b_logs": b_logs,
               "b_alive": [proc.poll() is None for proc, _ in on_b], "ns_left": ns_alive(there.name),
               "a_alive": a_alive, "b_pids": [proc.pid for proc, _ in on_b],
               "controller_log": (logs / "controller-0.log").read_text(errors="replace")}


def test_host_b_worked_over_the_network_and_went_down_mid_run(host_down_run):
    at_down = host_down_run["at_down"]
    expected = ROWS - HOLDOUT
    gen = at_down["stages"]["generate"]
    assert gen["done"] + gen["failed"] + gen["dropped"] < expected, "host B finished generation before going down"
    generator_log, extractor_log = host_down_run["b_logs"]
    assert "Traceback" not in generator_log + extractor_log  # B's workers ran until the power went
    assert host_down_run["b_alive"] == [False, False]
    assert not host_down_run["ns_left"]
    # B went down holding a started generate job: the controller found its worker dead by its stale
    # heartbeat and gave that job back to the queue.
    generator_pid = host_down_run["b_pids"][0]
    requeued = [line for line in host_down_run["controller_log"].splitlines()
                if f"-{generator_pid} is dead; requeued" in line]
    assert requeued and "job generate_host-down_" in requeued[0], host_down_run["controller_log"][-3000:]


def test_the_run_completes_with_every_sample_verified_once(host_down_run):
    final, counts = host_down_run["final"], host_down_run["counts"]
    assert final["state"] == "complete", final
    paths = RunPaths(host_down_run["data"], RUN)
    expected = set(range(ROWS - HOLDOUT))
    files = sorted(paths.hidden_dir.rglob("*.safetensors"))
    ids = [int(p.stem) for p in files]
    assert len(ids) == len(set(ids)) and set(ids) == expected
    manifests = {}
    for shard in {p.parent for p in files}:
        manifests.update(read_manifest(shard / MANIFEST_NAME))
    for path, sample_id in zip(files, ids):
        verify_hidden_file(path, sha256=manifests[sample_id].sha256)
    assert {int(p.stem) for p in paths.generated_dir.rglob("*.json")} == expected
    assert counts["extract"].done == counts["generate"].done == len(expected)
    assert counts["extract"].failed == counts["generate"].failed == 0
    assert temp_files(paths.root) == []
    assert all(host_down_run["a_alive"])
