"""A real vLLM OpenAI-compatible server as a child process of a test, with its log kept on disk.

vLLM runs from its own virtual environment (``tools/vllm_cpu.sh`` creates it), never from the
project's: its pinned torch and transformers must not meet the project's. The repository goes on the
server's ``PYTHONPATH`` so ``--kv-transfer-config`` can name draftline's connector
(``services.extractor.vllm_connector``), which imports nothing but the standard library, torch and vLLM.

The server starts in a session of its own: vLLM forks an engine-core and a worker process, and
stopping it means signalling all three, so the whole process group is terminated (then killed).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.processes import REPO, free_port

log = logging.getLogger(__name__)

VLLM_SCRIPT = REPO / "tools" / "vllm_cpu.sh"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # vllm-cpu's `vllm` console command does not start
CPU_ARGS = ("--dtype", "float32", "--enforce-eager")  # exact float32 for comparisons; no compile step
# The KV cache vLLM reserves on a CPU host, in GiB; a test's requests fit many times into one.
DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
CONNECTOR_MODULE = "services.extractor.vllm_connector"
CONNECTOR_CLASS = "CpuHiddenStatesConnector"


class VLLMServerError(RuntimeError):
    """The vLLM environment could not be set up, or its server exited or did not become healthy."""


@dataclass(frozen=True)
class VLLMTarget:
    """A running server as the tests use it."""

    url: str
    model: str  # the served model name requests carry
    model_dir: Path
    layer_ids: tuple[int, ...]  # whose states every request saves
    storage: Path  # where the connector writes hidden-state files
    log_path: Path
    startup_s: float  # from starting the process to a healthy ``GET /health``


def vllm_python(script: Path = VLLM_SCRIPT, timeout: float = 1200.0) -> Path:
    """The vLLM environment's python, created first by ``tools/vllm_cpu.sh`` when it is missing."""
    result = subprocess.run(["bash", str(script)], check=False, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise VLLMServerError(f"{script} failed with {result.returncode}:\n{result.stderr[-4000:]}")
    python = Path(result.stdout.strip().splitlines()[-1])
    if not python.is_file():
        raise VLLMServerError(f"{script} printed {python}, which is not a file:\n{result.stderr[-2000:]}")
    return python


def hidden_state_args(layer_ids: Sequence[int], storage: Path, *, only_when_asked: bool = False) -> list[str]:
    """Arguments that make every request save the states of ``layer_ids`` under ``storage`` (with
    ``only_when_asked``, only the requests whose ``kv_transfer_params`` carry ``save_hidden_states``).

    The ``extract_hidden_states`` speculative method caches those layers' outputs during the forward
    pass; the connector writes a finished request's cached states to ``storage`` and returns the file's
    path in the response's ``kv_transfer_params.hidden_states_path``.
    """
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }
    transfer = {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage), "save_only_when_asked": only_when_asked},
    }
    return ["--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer)]


def log_tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"(no log: {exc})"


def _stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        log.warning("vLLM server %d ignored SIGTERM for %.0fs: killing its process group", proc.pid, grace)
    try:  # the engine core and worker can outlive the API server; the group goes either way
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout: float) -> float:
    """Seconds until ``GET /health`` answered 200; raises, naming the log and its tail, otherwise."""
    started = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise VLLMServerError(f"vLLM server exited with {proc.returncode} before it was healthy; "
                                  f"log {log_path}:\n{log_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        if time.monotonic() - started > timeout:
            raise VLLMServerError(f"vLLM server not healthy after {timeout:.0f}s; log {log_path}:\n{log_tail(log_path)}")
        time.sleep(0.5)


@contextmanager
def vllm_server(
    python: Path,
    model_dir: Path,
    log_path: Path,
    extra_args: Sequence[str] = CPU_ARGS,
    *,
    served_name: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 420.0,
    port: int | None = None,
) -> Iterator[str]:
    """Start ``python -m vllm.entrypoints.openai.api_server`` for ``model_dir`` on a free loopback port (or
    ``port``: a restarted server keeps the URL its clients hold), wait until it is healthy and yield its base
    URL (``http://127.0.0.1:PORT``); stop it on exit."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(python), "-m", SERVER_MODULE, "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            *(["--served-model-name", served_name] if served_name else []), *extra_args]
    full_env = {**os.environ, **DEFAULT_ENV, **(env or {}), "PYTHONUNBUFFERED": "1"}
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [full_env.get("PYTHONPATH")])])
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        log_file.write(f"$ {' '.join(argv)}\n".encode())
        log_file.flush()
        proc = subprocess.Popen(argv, cwd=log_path.parent, env=full_env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        seconds = wait_healthy(proc, url, log_path, timeout)
        log.info("vLLM server for %s healthy at %s after %.1fs (log %s)", model_dir, url, seconds, log_path)
        yield url
    finally:
        _stop(proc)
