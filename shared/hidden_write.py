"""Write safetensors files straight from tensor memory, atomically, with the checksum computed on the way out.

``safetensors.save`` first builds the whole file as one bytes object (a copy of every tensor, made while
the writer holds the GIL); a hidden-state file is tens of MB, and in the inference server those copies
compete with the forward thread. Here the header is encoded on its own and each tensor's memory is
handed to the file as it is: ``write`` and ``sha256.update`` release the GIL for large buffers, and no
second copy of the data exists. The layout is the safetensors format itself (an 8-byte little-endian
header length, the JSON header padded with spaces to 8 bytes, then the tensors' bytes back to back), so
every safetensors reader and ``shared.hidden_file`` read the result.

Torch-free: callers pass raw buffers (``RawTensor.of`` takes a numpy array; a torch tensor's
``.view(torch.uint8).numpy()`` gives one without a copy).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.atomic import atomic_write

ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1,
            "F8_E4M3": 1}
_NUMPY_DTYPES = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", np.dtype(np.float64): "F64",
                 np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
                 np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8", np.dtype(np.bool_): "BOOL"}


@dataclass(frozen=True)
class RawTensor:
    """One tensor as the file stores it: its safetensors dtype, its shape and its C-ordered bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    def __post_init__(self) -> None:
        expected = math.prod(self.shape) * ITEMSIZE[self.dtype]
        if self.data.nbytes != expected:
            raise ValueError(f"{self.dtype} tensor of shape {self.shape} needs {expected} bytes, got {self.data.nbytes}")

    @classmethod
    def of(cls, array: np.ndarray, *, dtype: str | None = None, shape: tuple[int, ...] | None = None) -> RawTensor:
        """A view of ``array``'s memory (made contiguous only where it is not). ``dtype`` and ``shape``
        name what the bytes hold when the array is a reinterpretation (bf16 travels as raw uint8 or int16)."""
        contiguous = np.ascontiguousarray(array)
        name = dtype or _NUMPY_DTYPES[contiguous.dtype]
        return cls(name, tuple(shape if shape is not None else contiguous.shape), memoryview(contiguous).cast("B"))


@dataclass(frozen=True)
class WrittenFile:
    path: Path
    sha256: str
    nbytes: int


def header_bytes(tensors: Mapping[str, RawTensor], metadata: Mapping[str, str]) -> bytes:
    """The length prefix and JSON header for ``tensors`` stored in name order."""
    header: dict[str, object] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.data.nbytes]}
        offset += t.data.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(encoded)) + encoded


def write_safetensors(path: Path, tensors: Mapping[str, RawTensor], metadata: Mapping[str, str]) -> WrittenFile:
    """Publish ``path`` atomically (temp file, fsync, rename) and return its sha256 and size."""
    chunks = [header_bytes(tensors, metadata), *(tensors[name].data for name in sorted(tensors))]
    digest = hashlib.sha256()

    def write(handle) -> None:
        for chunk in chunks:
            handle.write(chunk)
            digest.update(chunk)

    atomic_write(Path(path), write)
    return WrittenFile(Path(path), digest.hexdigest(), sum(len(c) if isinstance(c, bytes) else c.nbytes for c in chunks))
