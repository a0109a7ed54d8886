"""A stand-in for the built-in server's ``POST /v1/hidden_states`` that runs no target.

It speaks the protocol ``services.extractor.client`` speaks to the built-in server: the request names the
tokens, the loss mask and a path on the shared volume; the stand-in writes a hidden-state file of the
right shapes there (atomically, through the writer the built-in server uses) and answers with what it
wrote. The states are pre-made zeros (finite, so the extractor's verification accepts them) of a target
of ``hidden_size`` and ``num_layers``, in bf16 or, for fp8 runs, e4m3 with scales of 1. Every answer is
immediate, so an extraction benchmark against it measures the orchestrator, not a forward pass.

It runs in a thread on a free loopback port (``tests.support.thread_server``, as the OpenAI stand-in
does); the requests it answered are counted in ``answered``.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path

import numpy as np
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from shared import SCHEMA_VERSION, eagle3
from shared.hidden_write import RawTensor, write_safetensors
from shared.layout import PathOutsideVolume, hidden_state_run, resolve_inside
from tests.support.thread_server import ThreadServer

log = logging.getLogger(__name__)

BF16 = "BF16"
BF16_ONE = 0x3F80  # 1.0 in bf16: a scale that keeps an fp8 state as it is


@lru_cache(maxsize=64)
def zeros(shape: tuple[int, ...], itemsize: int) -> np.ndarray:
    """Read-only zeros of ``shape``, made once per shape: the stand-in's states cost no work per request."""
    array = np.zeros(shape, dtype={1: np.uint8, 2: np.uint16}[itemsize])
    array.flags.writeable = False
    return array


@lru_cache(maxsize=64)
def unit_scales(tokens: int, layers: int) -> np.ndarray:
    array = np.full((tokens, layers), BF16_ONE, dtype=np.uint16)
    array.flags.writeable = False
    return array


def state_tensors(tokens: int, hidden: int, storage: str) -> dict[str, RawTensor]:
    """The states of one sample of ``tokens`` tokens as a file of ``storage`` holds them."""
    if storage != "fp8":
        return {eagle3.AUX_HIDDEN: RawTensor.of(zeros((tokens, 3 * hidden), 2), dtype=BF16),
                eagle3.LAST_HIDDEN: RawTensor.of(zeros((tokens, hidden), 2), dtype=BF16)}
    tensors = {}
    for name, width in ((eagle3.AUX_HIDDEN, 3 * hidden), (eagle3.LAST_HIDDEN, hidden)):
        scale_name, layers = eagle3.SCALES[name]
        tensors[name] = RawTensor.of(zeros((tokens, width), 1), dtype=eagle3.FP8_DTYPE)
        tensors[scale_name] = RawTensor.of(unit_scales(tokens, layers), dtype=eagle3.SCALE_DTYPE)
    return tensors


class HiddenStateServer(ThreadServer):
    """Writes zero states for every ``POST /v1/hidden_states`` under ``data``'s runs and answers at once."""

    name = "hidden-state-stand-in"

    def __init__(self, data: Path, *, hidden_size: int = 64, num_layers: int = 8, model: str = "stand-in-target") -> None:
        self.data = Path(data).resolve()
        self.hidden_size, self.model = hidden_size, model
        self.default_layers = eagle3.default_layer_ids(num_layers)
        super().__init__()
        self.answered = 0

    def write(self, body: dict) -> dict:
        """Write the file ``body`` asks for and describe it as the built-in server does."""
        target = resolve_inside(self.data, body["path"])
        if hidden_state_run(self.data, target) is None:
            raise PathOutsideVolume(f"{body['path']!r} is not under a run's hidden-state directory")
        ids, storage = body["input_ids"], body.get("storage") or "target"
        layers = list(body.get("layer_ids") or self.default_layers)
        tensors = {eagle3.INPUT_IDS: RawTensor.of(np.asarray(ids, dtype=np.int64)),
                   eagle3.LOSS_MASK: RawTensor.of(np.asarray(body["loss_mask"], dtype=np.uint8)),
                   **state_tensors(len(ids), self.hidden_size, storage)}
        metadata = {**body.get("metadata", {}), eagle3.META_FORMAT: eagle3.META_FORMAT_VALUE,
                    eagle3.META_SCHEMA: str(SCHEMA_VERSION), eagle3.META_LAYER_IDS: json.dumps(layers),
                    eagle3.META_CONVENTION: eagle3.LAYER_CONVENTION, eagle3.META_MODEL: self.model,
                    eagle3.META_DTYPE: BF16}
        written = write_safetensors(target, tensors, metadata)
        self.answered += 1
        return {"path": str(target.relative_to(self.data)), "num_tokens": len(ids),
                "shapes": {name: list(t.shape) for name, t in tensors.items()},
                "dtype": eagle3.FP8_DTYPE if storage == "fp8" else BF16, "layer_ids": layers,
                "layer_convention": eagle3.LAYER_CONVENTION, "sha256": written.sha256, "bytes": written.nbytes}

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        def health() -> dict:
            return {"status": "ok"}

        @app.post("/v1/hidden_states")
        def hidden_states(body: dict) -> JSONResponse:
            try:
                return JSONResponse(content=self.write(body))
            except (PathOutsideVolume, KeyError, TypeError, ValueError) as exc:
                error = {"error": {"message": str(exc), "type": "BadRequestError", "code": 400}}
                return JSONResponse(status_code=400, content=error)

        return app
