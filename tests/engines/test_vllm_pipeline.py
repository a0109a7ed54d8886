"""A whole run on real vLLM: one CPU vLLM server both generates and saves hidden states (draftline's
connector saves only the requests that ask: the extractor's), and the stack's own services (LocalStack, as
``make demo`` starts them) take the run through extraction, training and evaluation. The engine is killed
mid-run (after the first extracted sample, with the extractor's next request held at a gate so the kill lands
there however fast the workers run) and started again on the same port: the run completes, every generated
sample has its verified file, and no engine file is left behind, not even for the generation requests."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from contextlib import ExitStack

import httpx
import pytest

from services.cli.demo import demo_prompts_path
from services.cli.stack import LocalStack, StackConfig
from shared import eagle3
from shared.atomic import temp_files
from shared.hidden_file import verify_hidden_file
from shared.layout import RunPaths
from tests.engines import target64
from tests.support.gate_proxy import GateProxy
from tests.support.processes import free_port
from tests.support.runs import wait_terminal
from tests.support.vllm_server import CPU_ARGS, hidden_state_args, vllm_server

pytestmark = pytest.mark.slow

RUN = "on-vllm"
RUN_LAYERS = [0, 1, 2]


def engine_pids(port: int) -> list[int]:
    """The process group leader of the vLLM server listening on ``port`` (it started a session of its own)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in b" ".join(cmdline) and str(port).encode() in cmdline:
            found.append(int(pid))
    return found


@pytest.fixture(scope="module")
def finished(vllm_cpu_python, tiny64_dir, tmp_path_factory, redis_server):
    root = tmp_path_factory.mktemp("vllm-run")
    data, storage = root / "data", root / "data" / "engine-states"
    dataset = root / "prompts.jsonl"
    dataset.write_text("\n".join(demo_prompts_path().read_text().splitlines()[:24]) + "\n")
    saved = eagle3.engine_saved_layers(RUN_LAYERS, target64.NUM_LAYERS)
    port = free_port()
    engine_args = [*CPU_ARGS, *hidden_state_args(saved, storage, only_when_asked=True)]
    with ExitStack() as stack:
        url = stack.enter_context(vllm_server(vllm_cpu_python, tiny64_dir, root / "vllm.log", engine_args,
                                              served_name=target64.MODEL_NAME, port=port))
        # The extractor's first hidden-state request goes through; its next waits until the engine is killed.
        gate = stack.enter_context(GateProxy(url, let_through=1))
        env = {"DRAFTLINE_DATASET_ROOTS": str(root), "DRAFTLINE_INFERENCE_URL": url,
               "DRAFTLINE_HIDDEN_STATES_URL": gate.url, "DRAFTLINE_HIDDEN_SOURCE": "vllm",
               "DRAFTLINE_VLLM_STORAGE": str(storage), "DRAFTLINE_VLLM_SAVED_LAYERS": str(saved),
               "DRAFTLINE_RETRY_MAX_DELAY_S": "1",
               # One sample per extract job, one request per sample: the gate's count is a count of samples.
               "DRAFTLINE_EXTRACT_BATCH": "1"}
        config = StackConfig(data=data, model_dir=tiny64_dir, log_dir=root / "logs", redis_url=redis_server.url,
                             replicas={"inference": 0, "generator": 1, "extractor": 1}, env=env)
        with LocalStack(config) as local:
            body = {"dataset": str(dataset), "name": RUN, "model": target64.MODEL_NAME,
                    "generation": {"max_tokens": 32, "min_completion_tokens": 4},
                    "extraction": {"layer_ids": RUN_LAYERS},
                    "train": {"epochs": 2, "batch_size": 4, "lr": 2e-3, "ttt_steps": 2, "draft_vocab_size": 128},
                    "evaluate": {"holdout": 2, "max_new_tokens": 12, "draft_steps": 2, "humaneval_limit": 1,
                                 "curve_max_steps": 2}}
            response = httpx.post(f"{local.url('controller')}/runs", json=body, timeout=60)
            assert response.status_code == 201, response.text
            killed_at = kill_when_extracting(local, port, deadline_s=300)
            gate.open()  # the held request meets a dead engine, and is retried until the new one answers
            # Started again on the same port: generator and extractor find it there and carry on.
            stack.enter_context(vllm_server(vllm_cpu_python, tiny64_dir, root / "vllm-again.log", engine_args,
                                            served_name=target64.MODEL_NAME, port=port))
            status = wait_terminal(local, RUN, timeout=600.0)
    return {"status": status, "data": data, "storage": storage, "killed_at": killed_at, "gate": gate}


def kill_when_extracting(local: LocalStack, port: int, deadline_s: float) -> int:
    """SIGKILL the engine's process group once the first sample is extracted; the count then."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        done = httpx.get(f"{local.url('controller')}/runs/{RUN}", timeout=30).json()["stages"]["extract"]["done"]
        if done >= 1:
            pids = engine_pids(port)
            assert pids, "the engine's process was not found"
            for pid in pids:
                os.killpg(pid, signal.SIGKILL)
            wait_refused(port, deadline_s=30)
            return done
        time.sleep(0.2)
    raise AssertionError("no sample was extracted in time")


def wait_refused(port: int, deadline_s: float) -> None:
    """Until nothing listens on ``port``: a SIGKILL is delivered, not waited for."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return
        time.sleep(0.05)
    raise AssertionError(f"port {port} still answers after the engine was killed")


def test_the_run_completes_through_a_killed_engine_and_loses_nothing(finished):
    status, paths = finished["status"], RunPaths(finished["data"], RUN)
    assert status["state"] == "complete", (status["errors"], status["failures"], status["stages"])
    generated, extracted = status["stages"]["generate"], status["stages"]["extract"]
    assert generated["done"] + generated["dropped"] == status["expected"] == 22  # 24 rows, 2 held out
    assert finished["killed_at"] == 1  # the gate held the second sample's request
    assert extracted["done"] == generated["done"] > finished["killed_at"] and extracted["failed"] == 0
    gate = finished["gate"]
    # The held request met the dead engine (the gate then refused connections, as the dead engine's port did),
    # and was sent again once the new engine answered.
    assert gate.outages >= 1 and gate.posts > gate.answered == extracted["done"]
    files = sorted(paths.hidden_dir.rglob("*.safetensors"))
    assert len(files) == extracted["done"]
    for path in files:
        verify_hidden_file(path, layer_ids=RUN_LAYERS, hidden_size=128)
    assert temp_files(paths.root) == []
    for sample_id in range(status["expected"]):  # vLLM's own ids travelled with every reply kept
        record = paths.generated(sample_id)
        if record.exists():
            ids = json.loads(record.read_text())["token_ids"]
            assert ids["prompt"] and len(ids["reply"]) == json.loads(record.read_text())["usage"]["completion_tokens"]
    assert status["drafter"]["acceptance_length"] >= 1.0  # trained and evaluated to the end


def test_no_engine_file_is_left_behind(finished):
    leftovers = sorted(p.name for p in finished["storage"].iterdir()) if finished["storage"].exists() else []
    assert leftovers == []
