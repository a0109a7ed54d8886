"""Files written straight from tensor memory are ordinary safetensors files, published atomically, with the
checksum of the bytes on disk."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from shared.atomic import temp_files
from shared.hidden_write import RawTensor, write_safetensors


def raw(t: torch.Tensor, dtype: str) -> RawTensor:
    return RawTensor.of(t.contiguous().view(torch.uint8).numpy(), dtype=dtype, shape=tuple(t.shape))


def test_a_written_file_reads_back_with_safetensors_and_its_checksum_is_the_files(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "aux": torch.randn(7, 12, generator=gen).to(torch.bfloat16),
        "last": torch.randn(7, 4, generator=gen),
        "ids": torch.arange(7, dtype=torch.int64) * 1000,
        "mask": torch.tensor([0, 0, 1, 1, 1, 0, 1], dtype=torch.uint8),
    }
    dtypes = {"aux": "BF16", "last": "F32", "ids": "I64", "mask": "U8"}
    written = write_safetensors(tmp_path / "a" / "s.safetensors", {n: raw(t, dtypes[n]) for n, t in tensors.items()},
                                {"run": "r", "sample_id": "3"})
    data = written.path.read_bytes()
    assert written.nbytes == len(data) and written.sha256 == hashlib.sha256(data).hexdigest()
    with safe_open(str(written.path), framework="pt") as f:
        assert f.metadata() == {"run": "r", "sample_id": "3"}
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor)
    header_length = int.from_bytes(data[:8], "little")
    assert header_length % 8 == 0 and json.loads(data[8:8 + header_length])["ids"]["shape"] == [7]
    assert temp_files(tmp_path) == []


def test_numpy_arrays_are_taken_as_they_are_and_a_wrong_size_is_refused(tmp_path):
    ids = np.arange(5, dtype=np.int64)
    written = write_safetensors(tmp_path / "n.safetensors", {"ids": RawTensor.of(ids[::-1])}, {})
    with safe_open(str(written.path), framework="np") as f:
        assert f.get_tensor("ids").tolist() == [4, 3, 2, 1, 0]  # a strided view is made contiguous first
    with pytest.raises(ValueError, match="needs 40 bytes, got 8"):
        RawTensor("F32", (2, 5), memoryview(b"12345678"))
