"""Liveness and the model list (with the facts extraction and training need about the target)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from services.inference.routes.deps import RuntimeDep
from shared import eagle3

router = APIRouter()


@router.get("/health")
def health(runtime: RuntimeDep) -> dict[str, str]:
    return {"status": "ok", "model": runtime.loaded.name, "fingerprint": runtime.loaded.fingerprint}


@router.get("/v1/models")
def models(runtime: RuntimeDep) -> dict[str, Any]:
    loaded = runtime.loaded
    card = {
        "id": loaded.name,
        "object": "model",
        "created": runtime.started,
        "owned_by": "draftline",
        "root": str(runtime.settings.model_dir),
        "max_model_len": loaded.context_length,
        "draftline": {
            "fingerprint": loaded.fingerprint,
            "num_layers": loaded.num_layers,
            "hidden_size": loaded.hidden_size,
            "vocab_size": loaded.vocab_size,
            "default_layer_ids": loaded.default_layer_ids(),
            "layer_convention": eagle3.LAYER_CONVENTION,
            "dtype": loaded.dtype_name,
            "max_position_embeddings": loaded.context_length,
        },
    }
    return {"object": "list", "data": [card]}
