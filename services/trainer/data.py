"""Training data: a run's hidden-state files, each verified before training starts, read row-truncated.

A file that fails verification stops training with a HiddenStateFileError naming it: training on a
silently shrunken dataset is the failure this pipeline exists to prevent.

fp8 files (``extraction.storage = "fp8"``) say so themselves, by their dtypes and scale tensors; no
setting tells the trainer. Their states travel as fp8 with their scales up to ``Batch.to``, which
dequantizes on the training device: the host reads and copies half the bytes of bf16, and the
device does the arithmetic.
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from shared import eagle3
from shared.errors import HiddenStateFileError
from shared.hidden_file import HiddenFileInfo, verify_hidden_file
from shared.layout import RunPaths
from modeling.fp8 import dequantize_fp8

log = logging.getLogger(__name__)

SAMPLE_FILE_RE = re.compile(r"^(\d{8})\.safetensors$")
VERIFY_THREADS = 8


def list_hidden_files(paths: RunPaths) -> list[tuple[int, Path]]:
    """``(sample_id, path)`` of every finished sample file, by sample id (temp files never match)."""
    found = []
    for path in paths.hidden_dir.glob("rows_*/*.safetensors"):
        match = SAMPLE_FILE_RE.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def check_alike(first: HiddenFileInfo, info: HiddenFileInfo) -> None:
    """``info`` comes from ``first``'s target (model name and fingerprint), and is fp8 where it is: a batch carries
    scales for all its rows or for none."""
    for key in (eagle3.META_MODEL, eagle3.META_MODEL_FINGERPRINT):
        if info.metadata.get(key) != first.metadata.get(key):
            raise HiddenStateFileError(
                f"{info.path}: {key} {info.metadata.get(key)!r} differs from {first.metadata.get(key)!r} in {first.path}"
            )
    if (info.dtype == eagle3.FP8_DTYPE) != (first.dtype == eagle3.FP8_DTYPE):
        raise HiddenStateFileError(f"{info.path}: states in {info.dtype}, {first.path} stores {first.dtype}")


def verify_files(files: list[Path], *, layer_ids: list[int], hidden_size: int) -> list[HiddenFileInfo]:
    """Verify every file; all must be alike (``check_alike``)."""
    if not files:
        raise HiddenStateFileError("no hidden-state files to train on")
    # Hashing every byte is I/O-bound; threads overlap the reads (hashlib releases the GIL). ``map`` keeps
    # the order and raises the first failure.
    check = partial(verify_hidden_file, layer_ids=layer_ids, hidden_size=hidden_size)
    with ThreadPoolExecutor(max_workers=VERIFY_THREADS) as pool:
        infos = list(pool.map(check, files))
    for info in infos[1:]:
        check_alike(infos[0], info)
    log.info("verified %d hidden-state files (%d tokens)", len(infos), sum(i.num_tokens for i in infos))
    return infos


def loss_tokens_beyond(infos: list[HiddenFileInfo], limit: int) -> tuple[int, int]:
    """``(files, loss tokens)`` that reading only each file's first ``limit`` rows leaves out; only the
    small loss masks of the files longer than ``limit`` are read."""
    files = tokens = 0
    for info in infos:
        if info.num_tokens > limit:
            with safe_open(info.path, framework="pt") as handle:
                tokens += int(handle.get_slice(eagle3.LOSS_MASK)[limit:].sum())
            files += 1
    return files, tokens


def count_loss_tokens(files: list[Path], max_length: int) -> int:
    """Tokens training learns from: loss-masked positions within each file's first ``max_length`` rows
    (only the small loss masks are read)."""
    total = 0
    for path in files:
        with safe_open(path, framework="pt") as handle:
            total += int(handle.get_slice(eagle3.LOSS_MASK)[:max_length].sum())
    return total


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, L) int64, 0 after each row's length
    loss_mask: torch.Tensor  # (B, L) bool, False on padding
    aux_hidden: torch.Tensor  # (B, L, 3H)
    last_hidden: torch.Tensor  # (B, L, H)
    lengths: torch.Tensor  # (B,) int64
    aux_scale: torch.Tensor | None = None  # (B, L, 3) bf16 where the states are fp8, else None
    last_scale: torch.Tensor | None = None  # (B, L, 1)

    def without_loss(self) -> Batch:
        """The same rows with nothing to learn: a stand-in that runs the model but adds no loss or count."""
        return replace(self, loss_mask=torch.zeros_like(self.loss_mask))

    def pin_memory(self) -> Batch:
        """The DataLoader's ``pin_memory`` calls this on its pinning thread (a custom batch pins itself)."""
        pinned = {f.name: None if getattr(self, f.name) is None else getattr(self, f.name).pin_memory() for f in fields(self)}
        return Batch(**pinned)

    def to(self, device: torch.device, dtype: torch.dtype | None) -> Batch:
        """On ``device``, the states as ``dtype`` (None: as stored, or float32 from fp8). Moved first,
        converted second: a CPU-to-GPU copy that also changes dtype converts on the CPU, on one thread per
        rank under torchrun (OMP_NUM_THREADS=1), which was a third of a 2-GPU step; fp8 states are
        dequantized after the move for the same reason. From pinned memory the copies are asynchronous;
        the kernels that read them wait for them on the same stream."""
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=t.is_pinned())

        aux, last = move(self.aux_hidden), move(self.last_hidden)
        if self.aux_scale is not None and self.last_scale is not None:
            aux, last = dequantize_fp8(aux, move(self.aux_scale)), dequantize_fp8(last, move(self.last_scale))
        if dtype is not None:
            aux, last = aux.to(dtype), last.to(dtype)
        return Batch(move(self.input_ids), move(self.loss_mask), aux, last, move(self.lengths))


class HiddenStateDataset(Dataset):
    """One item per file: its first ``max_length`` rows (only those bytes are read)."""

    def __init__(self, files: list[Path], max_length: int) -> None:
        self.files = list(files)
        self.max_length = max_length

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """The sample's tensors as stored, an fp8 file's scales included."""
        with safe_open(self.files[index], framework="pt") as handle:
            names = [*eagle3.SAMPLE_TENSORS, *(name for name, _ in eagle3.SCALES.values() if name in handle.keys())]
            return {name: handle.get_slice(name)[: self.max_length] for name in names}


def collate(samples: list[dict[str, torch.Tensor]]) -> Batch:
    """Right-pad to the longest sample: causal attention keeps real positions blind to the padding.
    fp8 states keep their dtype and bring their scales (``verify_files`` lets no run mix the two)."""
    lengths = torch.tensor([s[eagle3.INPUT_IDS].shape[0] for s in samples])
    width = int(lengths.max())
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    for row, sample in enumerate(samples):
        ids[row, : int(lengths[row])] = sample[eagle3.INPUT_IDS]
        mask[row, : int(lengths[row])] = sample[eagle3.LOSS_MASK].bool()
    aux, last = (_padded(samples, lengths, name) for name in (eagle3.AUX_HIDDEN, eagle3.LAST_HIDDEN))
    scaled = eagle3.AUX_SCALE in samples[0]
    aux_scale, last_scale = (_padded(samples, lengths, name) if scaled else None
                             for name in (eagle3.AUX_SCALE, eagle3.LAST_SCALE))
    return Batch(ids, mask, aux, last, lengths, aux_scale, last_scale)


def _padded(samples: list[dict[str, torch.Tensor]], lengths: torch.Tensor, name: str) -> torch.Tensor:
    """``name`` of every sample in one zero-padded (B, L, C) tensor of its own dtype."""
    first = samples[0][name]
    out = torch.zeros(len(samples), int(lengths.max()), first.shape[1], dtype=first.dtype)
    for row, sample in enumerate(samples):
        out[row, : int(lengths[row])] = sample[name]
    return out
