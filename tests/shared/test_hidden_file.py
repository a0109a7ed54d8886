import json

import pytest
import torch
from safetensors.torch import save

from shared import eagle3
from shared.errors import HiddenStateFileError, HiddenStateScaleError
from shared.hidden_file import read_header, verify_hidden_file


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


def fp8_tensors(tokens=5, hidden=4, *, drop=(), scale=None, scale_dtype=torch.bfloat16) -> dict:
    """An fp8 sample: e4m3 states and their bf16 scales, [L, 3] and [L, 1]."""
    tensors = {
        eagle3.INPUT_IDS: torch.arange(tokens, dtype=torch.int64),
        eagle3.LOSS_MASK: torch.ones(tokens, dtype=torch.uint8),
        eagle3.AUX_HIDDEN: torch.randn(tokens, 3 * hidden).to(torch.float8_e4m3fn),
        eagle3.LAST_HIDDEN: torch.randn(tokens, hidden).to(torch.float8_e4m3fn),
        eagle3.AUX_SCALE: (torch.rand(tokens, 3) + 0.1).to(scale_dtype),
        eagle3.LAST_SCALE: (torch.rand(tokens, 1) + 0.1).to(scale_dtype) if scale is None else scale,
    }
    return {name: t for name, t in tensors.items() if name not in drop}


def write_tensors(path, tensors, layer_ids=(1, 3, 4)):
    metadata = {eagle3.META_FORMAT: eagle3.META_FORMAT_VALUE, eagle3.META_LAYER_IDS: json.dumps(list(layer_ids)),
                eagle3.META_CONVENTION: eagle3.LAYER_CONVENTION}
    path.write_bytes(save(tensors, metadata=metadata))
    return path


def test_an_fp8_file_with_its_scales_verifies_as_fp8(tmp_path):
    info = verify_hidden_file(write_tensors(tmp_path / "s.safetensors", fp8_tensors()), dtype="F8_E4M3", hidden_size=4)
    assert (info.num_tokens, info.hidden_size, info.dtype) == (5, 4, "F8_E4M3")
    with pytest.raises(HiddenStateFileError, match="dtype F8_E4M3, run expects BF16"):
        verify_hidden_file(tmp_path / "s.safetensors", dtype="BF16")


@pytest.mark.parametrize("missing", [eagle3.AUX_SCALE, eagle3.LAST_SCALE])
def test_an_fp8_file_without_a_scale_tensor_is_a_named_error(tmp_path, missing):
    path = write_tensors(tmp_path / "s.safetensors", fp8_tensors(drop=(missing,)))
    with pytest.raises(HiddenStateScaleError, match=f"without their scale tensor {missing}"):
        verify_hidden_file(path)


@pytest.mark.parametrize("tensors,words", [
    (fp8_tensors(scale=torch.ones(5, 2, dtype=torch.bfloat16)), r"hidden_states_scale has shape \[5, 2\], expected \[5, 1\]"),
    (fp8_tensors(scale=torch.ones(4, 1, dtype=torch.bfloat16)), r"hidden_states_scale has shape \[4, 1\], expected \[5, 1\]"),
    (fp8_tensors(scale_dtype=torch.float32), "aux_hidden_states_scale is F32, fp8 scales are BF16"),
])
def test_an_fp8_scale_of_another_shape_or_dtype_is_a_named_error(tmp_path, tensors, words):
    with pytest.raises(HiddenStateScaleError, match=words):
        verify_hidden_file(write_tensors(tmp_path / "s.safetensors", tensors))


@pytest.mark.parametrize("bad", [0.0, -0.0, -1.0, float("nan"), float("inf")])
def test_a_scale_that_is_not_finite_and_positive_is_rejected(tmp_path, bad):
    scale = torch.ones(5, 1, dtype=torch.bfloat16)
    scale[3, 0] = bad
    with pytest.raises(HiddenStateScaleError, match="hidden_states_scale: 1 scales that are not finite and positive"):
        verify_hidden_file(write_tensors(tmp_path / "s.safetensors", fp8_tensors(scale=scale)))


def test_a_nan_among_fp8_states_is_rejected(tmp_path):
    tensors = fp8_tensors()
    aux = tensors[eagle3.AUX_HIDDEN].view(torch.uint8).clone()
    aux[1, 2] = 0xFF  # e4m3fn's NaN (0x7F with the sign bit)
    tensors[eagle3.AUX_HIDDEN] = aux.view(torch.float8_e4m3fn)
    with pytest.raises(HiddenStateFileError, match="aux_hidden_states: 1 non-finite values"):
        verify_hidden_file(write_tensors(tmp_path / "s.safetensors", tensors))


def test_scales_beside_bf16_states_are_rejected(tmp_path):
    tensors = {**fp8_tensors(), eagle3.AUX_HIDDEN: torch.randn(5, 12).bfloat16(), eagle3.LAST_HIDDEN: torch.randn(5, 4).bfloat16()}
    with pytest.raises(HiddenStateScaleError, match="states in BF16 but scale tensors"):
        verify_hidden_file(write_tensors(tmp_path / "s.safetensors", tensors))


def test_fp8_states_beside_bf16_states_are_rejected(tmp_path):
    tensors = {**fp8_tensors(), eagle3.LAST_HIDDEN: torch.randn(5, 4).bfloat16()}
    with pytest.raises(HiddenStateFileError, match="differ in dtype"):
        verify_hidden_file(write_tensors(tmp_path / "s.safetensors", tensors))


def test_a_flipped_byte_in_an_fp8_file_fails_its_checksum(tmp_path):
    path = write_tensors(tmp_path / "s.safetensors", fp8_tensors())
    digest = verify_hidden_file(path).sha256
    header, data_start = read_header(path)
    at = data_start + header[eagle3.LAST_HIDDEN]["data_offsets"][0] + 7  # one fp8 state; sizes and header still agree
    raw = bytearray(path.read_bytes())
    raw[at] = 0x01 if raw[at] == 0x00 else 0x00  # another finite value
    path.write_bytes(bytes(raw))
    with pytest.raises(HiddenStateFileError, match="checksum"):
        verify_hidden_file(path, sha256=digest)
