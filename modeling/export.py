"""The exported drafter: ``config.json`` + ``model.safetensors`` that vLLM and SGLang load as
``LlamaForCausalLMEagle3``, written atomically and verified key by key (``shared.drafter_format``, which
also explains the layer-id conventions) before it is published; and loading one back for training.

``rope_theta``, ``rope_scaling`` and ``max_position_embeddings`` are the drafter's own (its config's: the
target's, or a base checkpoint's when fine-tuning), the ones it trained with: an engine that rotates with
other frequencies, or caps the drafter's context at another length, serves a different drafter.

The norm switches the engines read are written out, each as the drafter computes it: ``fc_norm`` (EAGLE-3.1's
per-layer norm of the auxiliary states, ``train.aux_norm``), and ``norm_before_fc`` and ``norm_output`` false
(``shared.drafter_format`` says which engine reads what, and refuses a checkpoint that sets the last two).
"""

from __future__ import annotations

import logging
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load_file

from shared import SCHEMA_VERSION, eagle3
from shared.atomic import atomic_write_json
from shared.errors import CheckpointFormatError
from shared.drafter_format import (
    ARCHITECTURE,
    CONFIG_FILE,
    FC_NORM,
    MAPPING_TENSORS,
    WEIGHTS_FILE,
    check_drafter,
    layer_ids_of,
    read_config,
    read_mapping,
    verify_export,
    vllm_layer_ids,
    with_engine_defaults,
)
from modeling.tensor_files import write_safetensors
from shared.atomic import atomic_dir
from modeling.eagle3 import DrafterConfig, Eagle3Drafter, rope_scaling_of, rope_theta_of
from modeling.target_head import load_target_head, read_target_config, text_config

log = logging.getLogger(__name__)


TORCH_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def export_config(dc: DrafterConfig, *, target_model: str, target_fingerprint: str, dtype: torch.dtype) -> dict[str, Any]:
    ids = list(dc.layer_ids)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": dc.hidden_size,
        "intermediate_size": dc.intermediate_size,
        "num_attention_heads": dc.num_attention_heads,
        "num_key_value_heads": dc.num_key_value_heads,
        "head_dim": dc.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": dc.rms_norm_eps,
        "rope_theta": dc.rope_theta,
        "rope_scaling": dict(dc.rope_scaling) if dc.rope_scaling else None,
        "max_position_embeddings": dc.max_position_embeddings,
        "attention_bias": False,
        "norm_before_residual": False,  # the residual starts from the un-normed hidden state (vLLM's default)
        FC_NORM: dc.aux_norm,  # one RMSNorm per auxiliary state before fc (fc_norm.0/1/2.weight), or none
        "norm_before_fc": False,  # no single norm over the concatenated states (vLLM's and SGLang's default)
        "norm_output": False,  # the next chain step gets the pre-norm state (both engines' default)
        "vocab_size": dc.vocab_size,
        "draft_vocab_size": dc.draft_vocab_size,
        "tie_word_embeddings": False,
        "target_hidden_size": dc.target_hidden_size,
        "torch_dtype": TORCH_DTYPE_NAMES[dtype],
        "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(ids),  # vLLM reads this first (input of layer id)
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},  # SGLang (output of layer id)
        "draftline": {
            "schema_version": SCHEMA_VERSION,
            "layer_convention": eagle3.LAYER_CONVENTION,
            "layer_ids": ids,
            "target_model": target_model,
            "target_fingerprint": target_fingerprint,
        },
    }


def publish(out_dir: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], dtype: torch.dtype,
            verify: Callable[[Path], Any]) -> None:
    """``config.json`` and ``model.safetensors`` (float tensors as ``dtype``) written to a temp directory,
    checked by ``verify``, then renamed over ``out_dir``: a failed check publishes nothing."""
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    with atomic_dir(Path(out_dir)) as tmp:
        atomic_write_json(tmp / CONFIG_FILE, config)
        write_safetensors(tmp / WEIGHTS_FILE, tensors, metadata={"format": "pt"})
        verify(tmp)


def export_drafter(
    drafter: Eagle3Drafter, out_dir: Path, *, target_model: str, target_fingerprint: str, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write the export to a temp directory, verify it, then rename it over ``out_dir``."""
    config = export_config(drafter.config, target_model=target_model, target_fingerprint=target_fingerprint, dtype=dtype)
    publish(out_dir, config, drafter.export_state(), dtype, verify_export)
    log.info("drafter exported to %s (%s, layer ids %s, rope_scaling %s, max_position_embeddings %d)", out_dir,
             config["torch_dtype"], list(drafter.config.layer_ids), config["rope_scaling"], config["max_position_embeddings"])
    return Path(out_dir)


# ---- loading back --------------------------------------------------------------------------------

def drafter_config_of(config: dict[str, Any], layer_ids: list[int]) -> DrafterConfig:
    """The drafter a checkpoint's config describes, with the engines' defaults for what it omits."""
    config = with_engine_defaults(config)
    return DrafterConfig(
        hidden_size=config["hidden_size"],
        target_hidden_size=config.get("target_hidden_size") or config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        layer_ids=tuple(layer_ids),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta_of(config),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        rope_scaling=rope_scaling_of(config),
        aux_norm=config.get(FC_NORM) is True,
    )


def load_drafter(path: Path, target_dir: Path, *, embed: torch.Tensor | None = None) -> Eagle3Drafter:
    """An exported (or published EAGLE-3) drafter in float32 on the CPU, with the target's embedding.

    Our own exports are verified in full; a published checkpoint needs the same tensors and shapes, and
    may lack ``d2t``/``t2d`` (``mapping_tensors`` tells; the drafter's mapping is then all zeros and the
    trainer sets one from the data) or hold only one of them (the other is derived). Its ``fc_norm``, as the
    engines read it, decides whether the drafter normalizes its auxiliary states; a config that asks the
    engines for a norm the drafter does not compute is refused by name (``check_drafter``).
    """
    path = Path(path)
    config = read_config(path)
    check_drafter(path, config)
    target_layers = int(text_config(read_target_config(target_dir))["num_hidden_layers"])
    drafter = Eagle3Drafter(drafter_config_of(config, layer_ids_of(config, target_layers, path=path)))
    weights = {k: v.float() if v.is_floating_point() else v for k, v in load_file(path / WEIGHTS_FILE).items()}
    weights.pop("embed_tokens.weight", None)  # a published drafter may carry its own copy; ours is the target's
    for name in MAPPING_TENSORS:
        weights.pop(name, None)  # set below, a missing half derived from the other
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not m.startswith("embed_tokens.") and m not in MAPPING_TENSORS]
    if missing or unexpected:
        raise CheckpointFormatError(f"{path}: missing {missing}, unexpected {unexpected}")
    mapping = read_mapping(path, drafter.config.vocab_size)
    if mapping is not None:
        drafter.set_vocab_mapping(*(torch.from_numpy(array.copy()) for array in mapping))
    drafter.load_embedding(load_target_head(target_dir).embed if embed is None else embed)
    return drafter
