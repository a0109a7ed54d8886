"""Fixtures for the CUDA tests: the tiny target loaded by the server's own loader on the GPU (bf16) and on
the CPU (float32, the reference), and the trainer's fixtures (hidden-state files from real forward passes).

Every test here is marked ``gpu``: tests/conftest.py skips it where no CUDA device is visible, and fails it
there under ``DRAFTLINE_REQUIRE_GPU=1`` (bench/run_gpu_tests.sh sets it on the lent H200).
"""

from __future__ import annotations

from pathlib import Path

import pytest

# The trainer's fixtures, registered here too: hidden-state files made from the tiny target's own replies.
from tests.support.tiny_runs import eval_messages, tiny_samples, tiny_target, trained_drafter  # noqa: F401


@pytest.fixture(scope="session")
def loaded_cuda(tiny_model_dir: Path):
    """The tiny target as the inference server loads it with ``DRAFTLINE_DEVICE=cuda`` (dtype auto)."""
    from services.inference.model import load_model
    from shared.settings import InferenceSettings

    return load_model(InferenceSettings(model_dir=tiny_model_dir, device="cuda"))


@pytest.fixture(scope="session")
def loaded_tiny_cuda_fp32(tiny_model_dir: Path):
    """The tiny target on the GPU in float32: the slot decoder's logits are held to its own full forward."""
    from services.inference.model import load_model
    from shared.settings import InferenceSettings

    return load_model(InferenceSettings(model_dir=tiny_model_dir, device="cuda", dtype="float32"))


@pytest.fixture(scope="session")
def loaded_cpu(tiny_model_dir: Path):
    """The same target in float32 on the CPU: the reference the GPU's bf16 results are held to."""
    from services.inference.model import load_model
    from shared.settings import InferenceSettings

    return load_model(InferenceSettings(model_dir=tiny_model_dir, device="cpu"))
