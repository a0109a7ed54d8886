"""The vLLM source's own writing, without a vLLM server: an engine's states become a verified draftline file."""

from __future__ import annotations

import pytest
import torch

from services.extractor import vllm_source
from services.extractor.vllm_source import VllmHiddenStates
from services.inference import hidden
from shared import eagle3
from shared.hidden_file import verify_hidden_file

NUM_LAYERS = 8  # the tiny target's


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_both_sources_store_the_same_states_as_the_same_fp8_bytes(dtype):
    states = (torch.randn(6, 3 * 16) * torch.logspace(-3, 3, 48)).to(dtype)
    states[2] = 0.0  # a row of zeros keeps a positive scale in both
    name = "BF16" if dtype == torch.bfloat16 else "F32"
    ours = vllm_source.state_tensors(eagle3.AUX_HIDDEN, states, "fp8", name)
    theirs = hidden.state_tensors(eagle3.AUX_HIDDEN, states, "fp8", name)
    assert sorted(ours) == sorted(theirs) == [eagle3.AUX_HIDDEN, eagle3.AUX_SCALE]
    for key in ours:
        assert (ours[key].dtype, ours[key].shape) == (theirs[key].dtype, theirs[key].shape)
        assert bytes(ours[key].data) == bytes(theirs[key].data)
    assert ours[eagle3.AUX_SCALE].shape == (6, 3) and ours[eagle3.AUX_HIDDEN].dtype == "F8_E4M3"


@pytest.mark.parametrize("storage,dtype", [("target", "F32"), ("fp8", "F8_E4M3")])
def test_an_engine_file_becomes_a_verified_file_in_the_runs_storage(tmp_path, tiny_model_dir, storage, dtype):
    source = VllmHiddenStates("http://127.0.0.1:9", model="tiny", model_dir=tiny_model_dir, data=tmp_path,
                              storage=tmp_path / "engine", saved_layers=None, timeout_s=5)
    layers = eagle3.default_layer_ids(NUM_LAYERS)
    saved = eagle3.engine_saved_layers(layers, NUM_LAYERS)
    states = torch.randn(9, len(saved), 64)  # (T, saved layers, H) as vLLM stores them
    result = source._write(states, saved, layers, list(range(9)), [0] * 4 + [1] * 5, "s.safetensors", {"run": "r"},
                           storage)
    info = verify_hidden_file(tmp_path / "s.safetensors", layer_ids=layers, dtype=dtype, hidden_size=64,
                              sha256=result.sha256)
    assert (result.dtype, info.num_tokens, result.bytes) == (dtype, 9, info.nbytes)
