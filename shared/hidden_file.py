"""Read and verify hidden-state files without torch: the safetensors header is JSON, the data raw.

A file counts as a finished sample only if ``verify_hidden_file`` accepts it: the header parses, every
tensor is present with the dtype and shape the token count implies, layer ids and convention are what
the run expects, every value is finite, and (when given) the checksum matches. An fp8 file (both states
``F8_E4M3``) must also hold each state's bf16 scales, ``[L, layers]``, every one finite and positive; a
file in any other dtype must hold none.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared import eagle3
from shared.errors import HiddenStateFileError, HiddenStateScaleError

# Raw bit patterns: a float is non-finite when all exponent bits are set. e4m3fn has no infinity, and its
# NaN is the one pattern with every exponent and mantissa bit set.
_EXPONENT_MASKS = {"BF16": (np.uint16, 0x7F80), "F16": (np.uint16, 0x7C00), "F32": (np.uint32, 0x7F800000),
                   eagle3.FP8_DTYPE: (np.uint8, 0x7F)}
_SIGN_BF16 = 0x8000
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "U8": 1, "BOOL": 1, "I32": 4, eagle3.FP8_DTYPE: 1}
HEADER_LIMIT = 100 * 1024 * 1024


@dataclass(frozen=True)
class HiddenFileInfo:
    path: Path
    num_tokens: int
    hidden_size: int
    dtype: str
    layer_ids: list[int]
    metadata: dict[str, str]
    sha256: str
    nbytes: int


def read_header(path: Path) -> tuple[dict, int]:
    """The safetensors header (tensor name -> dtype, shape, offsets; plus ``__metadata__``) and where data starts."""
    try:
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise HiddenStateFileError(f"{path}: shorter than a safetensors header")
            (length,) = struct.unpack("<Q", prefix)
            if length > HEADER_LIMIT:
                raise HiddenStateFileError(f"{path}: header length {length} is implausible")
            header = json.loads(handle.read(length))
    except FileNotFoundError:
        raise HiddenStateFileError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HiddenStateFileError(f"{path}: header is not valid JSON ({exc})") from None
    return header, 8 + length


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_hidden_file(
    path: Path,
    *,
    layer_ids: list[int] | None = None,
    dtype: str | None = None,
    hidden_size: int | None = None,
    sha256: str | None = None,
) -> HiddenFileInfo:
    """Check one file completely; raise HiddenStateFileError naming the first problem."""
    path = Path(path)
    header, data_start = read_header(path)
    meta = header.pop("__metadata__", {}) or {}
    missing = [name for name in eagle3.SAMPLE_TENSORS if name not in header]
    if missing:
        raise HiddenStateFileError(f"{path}: missing tensors {missing}")
    if meta.get(eagle3.META_FORMAT) != eagle3.META_FORMAT_VALUE:
        raise HiddenStateFileError(f"{path}: not a draftline hidden-state file (format={meta.get(eagle3.META_FORMAT)!r})")
    (num_tokens,) = _shape(header, eagle3.INPUT_IDS, path, ndim=1)
    _expect(header, eagle3.LOSS_MASK, [num_tokens], path)
    last_tokens, hidden = _shape(header, eagle3.LAST_HIDDEN, path, ndim=2)
    _expect(header, eagle3.LAST_HIDDEN, [num_tokens, hidden], path)
    _expect(header, eagle3.AUX_HIDDEN, [num_tokens, 3 * hidden], path)
    float_dtype = header[eagle3.LAST_HIDDEN]["dtype"]
    if header[eagle3.AUX_HIDDEN]["dtype"] != float_dtype:
        raise HiddenStateFileError(f"{path}: auxiliary and last hidden states differ in dtype")
    if dtype is not None and float_dtype != dtype:
        raise HiddenStateFileError(f"{path}: dtype {float_dtype}, run expects {dtype}")
    if hidden_size is not None and hidden != hidden_size:
        raise HiddenStateFileError(f"{path}: hidden size {hidden}, run expects {hidden_size}")
    file_layers = json.loads(meta.get(eagle3.META_LAYER_IDS, "null"))
    if meta.get(eagle3.META_CONVENTION) != eagle3.LAYER_CONVENTION:
        raise HiddenStateFileError(f"{path}: layer convention {meta.get(eagle3.META_CONVENTION)!r} is not {eagle3.LAYER_CONVENTION!r}")
    if layer_ids is not None and file_layers != list(layer_ids):
        raise HiddenStateFileError(f"{path}: layer ids {file_layers}, run expects {list(layer_ids)}")
    size = path.stat().st_size
    end = max(info["data_offsets"][1] for info in header.values())
    if data_start + end != size:
        raise HiddenStateFileError(f"{path}: {size} bytes on disk, header describes {data_start + end} (truncated?)")
    scales = _scale_tensors(header, float_dtype, num_tokens, path)
    raw = path.read_bytes()
    for name in (eagle3.AUX_HIDDEN, eagle3.LAST_HIDDEN):
        _check_finite(raw, header[name], data_start, f"{path}: {name}")
    for name in scales:
        _check_positive(raw, header[name], data_start, f"{path}: {name}")
    digest = hashlib.sha256(raw).hexdigest()
    if sha256 is not None and digest != sha256:
        raise HiddenStateFileError(f"{path}: checksum {digest[:12]}… differs from the recorded {sha256[:12]}…")
    return HiddenFileInfo(path, num_tokens, hidden, float_dtype, file_layers, dict(meta), digest, size)


def _shape(header: dict, name: str, path: Path, *, ndim: int) -> list[int]:
    shape = header[name]["shape"]
    if len(shape) != ndim:
        raise HiddenStateFileError(f"{path}: {name} has {len(shape)} dimensions, expected {ndim}")
    return shape


def _expect(header: dict, name: str, shape: list[int], path: Path) -> None:
    info = header[name]
    if info["shape"] != shape:
        raise HiddenStateFileError(f"{path}: {name} has shape {info['shape']}, expected {shape}")
    start, end = info["data_offsets"]
    itemsize = _ITEMSIZE.get(info["dtype"])
    if itemsize is None or end - start != itemsize * int(np.prod(shape)):
        raise HiddenStateFileError(f"{path}: {name} byte range does not match {info['dtype']} {shape}")


def _scale_tensors(header: dict, float_dtype: str, num_tokens: int, path: Path) -> list[str]:
    """The scale tensors an fp8 file must hold, each checked for presence, shape and dtype; a file in
    another dtype must hold none (its states would be read as they are, and the scales ignored)."""
    names = [name for name, _ in eagle3.SCALES.values()]
    if float_dtype != eagle3.FP8_DTYPE:
        stray = [name for name in names if name in header]
        if stray:
            raise HiddenStateScaleError(f"{path}: states in {float_dtype} but scale tensors {stray} (only fp8 has scales)")
        return []
    for name, layers in eagle3.SCALES.values():
        if name not in header:
            raise HiddenStateScaleError(f"{path}: fp8 states without their scale tensor {name}")
        if header[name]["dtype"] != eagle3.SCALE_DTYPE:
            raise HiddenStateScaleError(f"{path}: {name} is {header[name]['dtype']}, fp8 scales are {eagle3.SCALE_DTYPE}")
        if header[name]["shape"] != [num_tokens, layers]:
            raise HiddenStateScaleError(f"{path}: {name} has shape {header[name]['shape']}, expected {[num_tokens, layers]}")
        _expect(header, name, [num_tokens, layers], path)
    return names


def _check_positive(raw: bytes, info: dict, data_start: int, what: str) -> None:
    """Every bf16 value finite and above zero: a zero, negative or non-finite scale makes no state."""
    start, end = info["data_offsets"]
    bits = np.frombuffer(raw, dtype=np.uint16, count=(end - start) // 2, offset=data_start + start)
    _, mask = _EXPONENT_MASKS["BF16"]
    bad = int(np.count_nonzero(((bits & mask) == mask) | ((bits & _SIGN_BF16) != 0) | ((bits & 0x7FFF) == 0)))
    if bad:
        raise HiddenStateScaleError(f"{what}: {bad} scales that are not finite and positive")


def _check_finite(raw: bytes, info: dict, data_start: int, what: str) -> None:
    kind = _EXPONENT_MASKS.get(info["dtype"])
    if kind is None:
        raise HiddenStateFileError(f"{what}: unsupported dtype {info['dtype']}")
    uint, mask = kind
    start, end = info["data_offsets"]
    bits = np.frombuffer(raw, dtype=uint, count=(end - start) // np.dtype(uint).itemsize, offset=data_start + start)
    bad = int(np.count_nonzero((bits & mask) == mask))
    if bad:
        raise HiddenStateFileError(f"{what}: {bad} non-finite values")
