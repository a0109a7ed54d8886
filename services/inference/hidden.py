"""One hidden-state sample: the forward pass that yields it and the safetensors file that stores it.

The file holds the states in the target's dtype, or (``storage="fp8"``) as float8 e4m3 with a bf16 scale
per token and layer, as ``shared.eagle3`` defines it. ``stored_states`` turns states into what the file
stores, wherever they live: the pipeline quantizes on the device, before the copy to the host, so the copy
moves half the bytes and the writer threads, which share one interpreter with the forward thread, only
write (quantizing there on the CPU held an 8B target's fp8 extraction at 0.77x of the forward, where bf16
files reached the disk's rate).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from services.inference.model import LoadedModel
from shared import SCHEMA_VERSION, eagle3
from shared.hidden_write import RawTensor, write_safetensors
from shared.runspec import HiddenStorage
from modeling.fp8 import quantize_fp8

RESERVED_METADATA = frozenset({
    eagle3.META_FORMAT, eagle3.META_SCHEMA, eagle3.META_LAYER_IDS, eagle3.META_CONVENTION,
    eagle3.META_MODEL, eagle3.META_MODEL_FINGERPRINT, eagle3.META_DTYPE,
})


@dataclass(frozen=True)
class HiddenJob:
    """A validated request: tokens, where the file goes (already resolved inside the volume), which layers."""

    input_ids: list[int]
    loss_mask: list[int]
    path: Path
    relative_path: str
    layer_ids: tuple[int, int, int]
    metadata: dict[str, str] = field(default_factory=dict)
    storage: HiddenStorage = "target"

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class WrittenSample:
    """What the endpoint reports about a file it wrote."""

    path: str
    num_tokens: int
    shapes: dict[str, list[int]]
    dtype: str
    layer_ids: list[int]
    sha256: str
    bytes: int
    layer_convention: str = eagle3.LAYER_CONVENTION


def right_pad(jobs: Sequence[HiddenJob], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` (B, T). Padding goes on the right: causal attention never lets
    a real token see a later pad, so each row's first L positions are exactly its own forward pass."""
    width = max(job.num_tokens for job in jobs)
    ids = torch.full((len(jobs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(jobs), width), dtype=torch.long)
    for row, job in enumerate(jobs):
        ids[row, : job.num_tokens] = torch.tensor(job.input_ids, dtype=torch.long)
        mask[row, : job.num_tokens] = 1
    return ids.to(device), mask.to(device)


def forward_hidden(loaded: LoadedModel, jobs: Sequence[HiddenJob]) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded ``(aux (B, T, 3H), last (B, T, H))`` on the model's device; call under inference_mode.

    The decoder stack (``base_model``) runs without ``lm_head``: its ``last_hidden_state`` is the final-norm
    output that feeds ``lm_head``, and skipping the (T, vocab) logits saves their memory and time.
    """
    ids, mask = right_pad(jobs, loaded.pad_token_id, loaded.device)
    out = loaded.model.base_model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    states = out.hidden_states  # embeddings, then the output of each decoder layer
    rows_by_layers: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for row, job in enumerate(jobs):
        rows_by_layers[job.layer_ids].append(row)
    if len(rows_by_layers) == 1:
        aux = _concat_layers(states, jobs[0].layer_ids)  # (B, T, 3H)
    else:
        batch, width, hidden = out.last_hidden_state.shape
        aux = out.last_hidden_state.new_empty((batch, width, 3 * hidden))
        for layer_ids, rows in rows_by_layers.items():
            index = torch.tensor(rows, device=aux.device)
            aux[index] = _concat_layers(states, layer_ids)[index]
    return aux, out.last_hidden_state


def _concat_layers(states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    return torch.cat([states[eagle3.hf_hidden_index(i)] for i in layer_ids], dim=-1)  # (B, T, 3H)


def sample_metadata(loaded: LoadedModel, job: HiddenJob) -> dict[str, str]:
    return {
        **job.metadata,
        eagle3.META_FORMAT: eagle3.META_FORMAT_VALUE,
        eagle3.META_SCHEMA: str(SCHEMA_VERSION),
        eagle3.META_LAYER_IDS: json.dumps(list(job.layer_ids)),
        eagle3.META_CONVENTION: eagle3.LAYER_CONVENTION,
        eagle3.META_MODEL: loaded.name,
        eagle3.META_MODEL_FINGERPRINT: loaded.fingerprint,
        eagle3.META_DTYPE: loaded.dtype_name,
    }


def host_tensor(t: torch.Tensor, dtype: str) -> RawTensor:
    """A host tensor's memory as the file stores it, without a copy (bf16 travels as its raw bytes)."""
    return RawTensor.of(t.contiguous().view(torch.uint8).numpy(), dtype=dtype, shape=tuple(t.shape))


def stored_states(aux: torch.Tensor, last: torch.Tensor, storage: str) -> dict[str, torch.Tensor]:
    """The state tensors as a file of ``storage`` holds them, on the states' device: as they are, or as
    fp8 beside their scales. Works on one sample's (L, ·) states or a batch's (B, T, ·)."""
    if storage != "fp8":
        return {eagle3.AUX_HIDDEN: aux, eagle3.LAST_HIDDEN: last}
    out = {}
    for name, states in ((eagle3.AUX_HIDDEN, aux), (eagle3.LAST_HIDDEN, last)):
        scale_name, layers = eagle3.SCALES[name]
        out[name], out[scale_name] = quantize_fp8(states, layers)
    return out


def raw_states(stored: dict[str, torch.Tensor], storage: str, dtype: str) -> dict[str, RawTensor]:
    """``stored_states``' tensors, on the host, as the file's raw tensors: states in ``dtype`` (the target's)
    or e4m3, scales in bf16."""
    scales = {scale for scale, _ in eagle3.SCALES.values()}
    state_dtype = eagle3.FP8_DTYPE if storage == "fp8" else dtype
    return {name: host_tensor(t, eagle3.SCALE_DTYPE if name in scales else state_dtype) for name, t in stored.items()}


def write_sample(loaded: LoadedModel, job: HiddenJob, aux: torch.Tensor, last: torch.Tensor) -> WrittenSample:
    """Write one sample's file atomically from its host states, ``aux`` (L, 3H) and ``last`` (L, H)."""
    return write_stored(loaded, job, stored_states(aux, last, job.storage))


def write_stored(loaded: LoadedModel, job: HiddenJob, stored: dict[str, torch.Tensor]) -> WrittenSample:
    """Write one sample's file atomically from host tensors already in the job's storage (``stored_states``)."""
    tensors = {
        eagle3.INPUT_IDS: RawTensor.of(np.asarray(job.input_ids, dtype=np.int64)),
        eagle3.LOSS_MASK: RawTensor.of(np.asarray(job.loss_mask, dtype=np.uint8)),
        **raw_states(stored, job.storage, loaded.dtype_name),
    }
    written = write_safetensors(job.path, tensors, sample_metadata(loaded, job))
    return describe_sample(loaded, job, written.sha256, written.nbytes)


def describe_sample(loaded: LoadedModel, job: HiddenJob, sha256: str, nbytes: int) -> WrittenSample:
    length, hidden = job.num_tokens, loaded.hidden_size
    return WrittenSample(
        path=job.relative_path,
        num_tokens=length,
        shapes={
            eagle3.INPUT_IDS: [length],
            eagle3.LOSS_MASK: [length],
            eagle3.AUX_HIDDEN: [length, 3 * hidden],
            eagle3.LAST_HIDDEN: [length, hidden],
        },
        dtype=eagle3.FP8_DTYPE if job.storage == "fp8" else loaded.dtype_name,
        layer_ids=list(job.layer_ids),
        sha256=sha256,
        bytes=nbytes,
    )
