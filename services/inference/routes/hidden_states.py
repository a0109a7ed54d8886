"""``POST /v1/hidden_states`` (draftline's own): run one sample through the target, write its states.

The server writes only ``.safetensors`` files into a run's hidden-state directory,
``<data>/runs/<run>/hidden_states/``: any other path on the volume (a drafter's export, a run's
``run.json``) is refused with **403**, a path outside the volume with 400. A full volume answers **507
Insufficient Storage** naming the volume and its free bytes; nothing of the file remains, and the server
keeps serving every other request.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

from fastapi import APIRouter

from services.inference.hidden import RESERVED_METADATA, HiddenJob
from services.inference.pipeline import VolumeFull
from services.inference.routes.deps import RuntimeDep
from services.inference.routes.errors import ApiError
from services.inference.runtime import HIDDEN_ENDPOINT, Runtime
from services.inference.schemas import SAFETENSORS_SUFFIX, HiddenStatesRequest
from shared import eagle3
from shared.errors import PromptTooLong
from shared.layout import hidden_state_run, resolve_inside

router = APIRouter()

INSUFFICIENT_STORAGE = 507
ALLOWED_ROOT = "<data>/runs/<run>/hidden_states/"


@router.post(HIDDEN_ENDPOINT)
async def hidden_states(body: HiddenStatesRequest, runtime: RuntimeDep) -> dict[str, Any]:
    job = build_job(runtime, body)
    try:
        written = await asyncio.wrap_future(runtime.pipeline.submit(job))
    except VolumeFull as exc:
        raise ApiError(INSUFFICIENT_STORAGE, "InsufficientStorageError", str(exc)) from None
    return dataclasses.asdict(written)


def resolve_inside_writable(volume: Path, path: str) -> Path:
    """``path`` on the volume, where a file can be written: not a directory, and under directories only."""
    try:
        target = resolve_inside(volume, path)  # PathOutsideVolume answers 400
        check_hidden_state_path(volume, target, path)
        is_dir = target.is_dir()
        blocking = next((p for p in target.parents if volume in p.parents and p.exists() and not p.is_dir()), None)
    except (ValueError, OSError) as exc:  # a NUL byte, or a name too long for the file system
        raise ApiError(400, "BadRequestError", f"path {path[:300]!r} is not usable: {exc}") from None
    if is_dir:
        raise ApiError(400, "BadRequestError", f"path {path!r} is a directory")
    if blocking is not None:
        raise ApiError(400, "BadRequestError", f"path {path!r}: {blocking.relative_to(volume)} is a file, not a folder")
    return target


def check_hidden_state_path(volume: Path, target: Path, path: str) -> None:
    """Refuse a resolved ``target`` outside every run's hidden-state directory, or not a safetensors file."""
    if hidden_state_run(volume, target) is None or not target.name.endswith(SAFETENSORS_SUFFIX):
        shown = target.relative_to(volume) if target != volume else "."
        raise ApiError(403, "PermissionDeniedError", f"path {path[:300]!r} resolves to {shown}: this server writes "
                       f"only {SAFETENSORS_SUFFIX} files under {ALLOWED_ROOT} on its volume {volume}")


def build_job(runtime: Runtime, body: HiddenStatesRequest) -> HiddenJob:
    """Check the request against the target and the volume; nothing is written unless all of it holds."""
    loaded = runtime.loaded
    volume = runtime.settings.data.resolve()
    target = resolve_inside_writable(volume, body.path)
    if len(body.input_ids) > loaded.context_length:
        raise PromptTooLong(f"{len(body.input_ids)} tokens exceed the model's context of {loaded.context_length}")
    too_big = [t for t in body.input_ids if t >= loaded.vocab_size]
    if too_big:
        raise ApiError(400, "BadRequestError", f"token id {too_big[0]} is outside the vocabulary of {loaded.vocab_size}")
    clash = sorted(RESERVED_METADATA.intersection(body.metadata))
    if clash:
        raise ApiError(400, "BadRequestError", f"metadata keys {clash} are reserved for the server")
    try:
        layer_ids = eagle3.check_layer_ids(body.layer_ids or loaded.default_layer_ids(), loaded.num_layers)
    except ValueError as exc:
        raise ApiError(400, "BadRequestError", str(exc)) from None
    return HiddenJob(
        input_ids=list(body.input_ids),
        loss_mask=list(body.loss_mask),
        path=target,
        relative_path=str(target.relative_to(volume)),
        layer_ids=tuple(layer_ids),
        metadata=dict(body.metadata),
        storage=body.storage,
    )
