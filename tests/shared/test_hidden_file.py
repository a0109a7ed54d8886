import json

import pytest
import torch
from safetensors.torch import save

from shared import eagle3
from shared.errors import HiddenStateFileError
from shared.hidden_file import verify_hidden_file


def write_sample(path, *, tokens=5, hidden=4, dtype=torch.bfloat16, layer_ids=(1, 3, 4), aux=None, meta=None):
    tensors = {
        eagle3.INPUT_IDS: torch.arange(tokens, dtype=torch.int64),
        eagle3.LOSS_MASK: torch.ones(tokens, dtype=torch.uint8),
        eagle3.AUX_HIDDEN: aux if aux is not None else torch.randn(tokens, 3 * hidden).to(dtype),
        eagle3.LAST_HIDDEN: torch.randn(tokens, hidden).to(dtype),
    }
    metadata = {
        eagle3.META_FORMAT: eagle3.META_FORMAT_VALUE,
        eagle3.META_LAYER_IDS: json.dumps(list(layer_ids)),
        eagle3.META_CONVENTION: eagle3.LAYER_CONVENTION,
        **(meta or {}),
    }
    path.write_bytes(save(tensors, metadata=metadata))
    return path


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "BF16"), (torch.float16, "F16"), (torch.float32, "F32")])
def test_a_good_file_verifies(tmp_path, dtype, name):
    info = verify_hidden_file(write_sample(tmp_path / "s.safetensors", dtype=dtype), layer_ids=[1, 3, 4], dtype=name)
    assert (info.num_tokens, info.hidden_size, info.dtype, info.layer_ids) == (5, 4, name, [1, 3, 4])


def test_truncated_file_is_rejected(tmp_path):
    path = write_sample(tmp_path / "s.safetensors")
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(HiddenStateFileError, match="truncated"):
        verify_hidden_file(path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_rejected(tmp_path, bad):
    aux = torch.zeros(5, 12, dtype=torch.bfloat16)
    aux[2, 3] = bad
    with pytest.raises(HiddenStateFileError, match="non-finite"):
        verify_hidden_file(write_sample(tmp_path / "s.safetensors", aux=aux))


def test_layer_ids_other_than_the_runs_are_rejected(tmp_path):
    path = write_sample(tmp_path / "s.safetensors", layer_ids=(2, 4, 5))
    with pytest.raises(HiddenStateFileError, match="layer ids"):
        verify_hidden_file(path, layer_ids=[1, 3, 4])


def test_checksum_mismatch_is_rejected(tmp_path):
    path = write_sample(tmp_path / "s.safetensors")
    with pytest.raises(HiddenStateFileError, match="checksum"):
        verify_hidden_file(path, sha256="0" * 64)


def test_garbage_and_missing_files_are_named(tmp_path):
    garbage = tmp_path / "g.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(HiddenStateFileError, match="not valid JSON"):
        verify_hidden_file(garbage)
    with pytest.raises(HiddenStateFileError, match="missing"):
        verify_hidden_file(tmp_path / "absent.safetensors")


def test_shape_disagreeing_with_token_count_is_rejected(tmp_path):
    aux = torch.zeros(4, 12, dtype=torch.bfloat16)  # 4 rows for 5 tokens
    with pytest.raises(HiddenStateFileError, match="shape"):
        verify_hidden_file(write_sample(tmp_path / "s.safetensors", aux=aux))
