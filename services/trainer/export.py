"""The exported drafter: ``config.json`` + ``model.safetensors`` that vLLM and SGLang load as
``LlamaForCausalLMEagle3``, written atomically and verified key by key before it is published.

Layer ids. draftline records auxiliary layers as *outputs of 0-indexed decoder layers*
(``shared.eagle3.LAYER_CONVENTION``; HF ``hidden_states[i + 1]``). The engines read the ids differently:

- SGLang reads only ``eagle_config.eagle_aux_hidden_state_layer_ids`` and captures at the *input* of
  layer ``id + 1`` (``set_eagle3_layers_to_capture``: ``layers_to_capture = [val + 1 ...]``), i.e. the
  output of layer ``id``: the same convention as ours, so it gets our ids unchanged.
- vLLM reads the top-level ``eagle_aux_hidden_state_layer_ids`` first and falls back to ``eagle_config``;
  its target models capture ``hidden_states + residual`` *before* running layer ``id`` (the input of
  layer ``id`` = the output of layer ``id - 1``). So vLLM needs our ids **plus one**, written top-level
  where it looks first and SGLang never looks.

With no ids at all both engines fall back to ``(2, N//2, N-3)`` in their own terms, which is our default
``[1, N//2 - 1, N - 4]``; writing the ids explicitly keeps non-default choices correct too. A vLLM
build that only reads ``eagle_config`` would be one layer off; ``verify_export`` pins both fields.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from shared import SCHEMA_VERSION, eagle3
from shared.atomic import atomic_write_json
from shared.errors import CheckpointFormatError
from services.trainer.checkpoint import atomic_dir, write_safetensors
from services.trainer.model import DrafterConfig, Eagle3Drafter
from services.trainer.target_head import load_target_head, read_target_config, text_config
from services.trainer.vocab import check_mapping

log = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
TORCH_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
CONFIG_TYPES: dict[str, type | tuple[type, ...]] = {
    "architectures": list, "model_type": str, "num_hidden_layers": int, "hidden_size": int,
    "intermediate_size": int, "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int,
    "rms_norm_eps": (int, float), "rope_theta": (int, float), "max_position_embeddings": int,
    "vocab_size": int, "draft_vocab_size": int, "tie_word_embeddings": bool, "target_hidden_size": int,
    "eagle_config": dict, "torch_dtype": str, "draftline": dict,
}


def vllm_layer_ids(layer_ids: list[int]) -> list[int]:
    """vLLM's id for each of our layers: it captures the input of layer ``id``, we mean the output."""
    return [int(i) + 1 for i in layer_ids]


def expected_tensors(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """Every tensor the engines need, with its shape; dtype None means "the float dtype of the config"."""
    h, i = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    ht = config.get("target_hidden_size") or h
    return {
        "midlayer.self_attn.q_proj.weight": ((q, 2 * h), None),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * h), None),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * h), None),
        "midlayer.self_attn.o_proj.weight": ((h, q), None),
        "midlayer.mlp.gate_proj.weight": ((i, h), None),
        "midlayer.mlp.up_proj.weight": ((i, h), None),
        "midlayer.mlp.down_proj.weight": ((h, i), None),
        "midlayer.input_layernorm.weight": ((h,), None),
        "midlayer.hidden_norm.weight": ((h,), None),
        "midlayer.post_attention_layernorm.weight": ((h,), None),
        "fc.weight": ((h, 3 * ht), None),
        "norm.weight": ((h,), None),
        "lm_head.weight": ((config["draft_vocab_size"], h), None),
        "d2t": ((config["draft_vocab_size"],), "I64"),
        "t2d": ((config["vocab_size"],), "BOOL"),
    }


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
        "rope_scaling": None,
        "max_position_embeddings": dc.max_position_embeddings,
        "attention_bias": False,
        "norm_before_residual": False,  # the residual starts from the un-normed hidden state (vLLM's default)
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


def export_drafter(
    drafter: Eagle3Drafter, out_dir: Path, *, target_model: str, target_fingerprint: str, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write the export to a temp directory, verify it, then rename it over ``out_dir``."""
    config = export_config(drafter.config, target_model=target_model, target_fingerprint=target_fingerprint, dtype=dtype)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in drafter.export_state().items()}
    with atomic_dir(Path(out_dir)) as tmp:
        atomic_write_json(tmp / CONFIG_FILE, config)
        write_safetensors(tmp / WEIGHTS_FILE, tensors, metadata={"format": "pt"})
        verify_export(tmp)
    log.info("drafter exported to %s (%s, layer ids %s)", out_dir, config["torch_dtype"], list(drafter.config.layer_ids))
    return Path(out_dir)


# ---- verification --------------------------------------------------------------------------------

def read_safetensors_header(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
    except FileNotFoundError:
        raise CheckpointFormatError(f"{path}: missing") from None
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointFormatError(f"{path}: not a safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    return header


def read_config(path: Path) -> dict[str, Any]:
    file = Path(path) / CONFIG_FILE
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointFormatError(f"{file}: missing") from None
    except json.JSONDecodeError as exc:
        raise CheckpointFormatError(f"{file}: not valid JSON ({exc})") from None


def check_tensors(path: Path, config: dict[str, Any]) -> None:
    """Every required tensor present with its shape and dtype; d2t/t2d a consistent mapping."""
    weights = Path(path) / WEIGHTS_FILE
    header = read_safetensors_header(weights)
    float_dtype = {v: SAFETENSORS_DTYPES[k] for k, v in TORCH_DTYPE_NAMES.items()}.get(config.get("torch_dtype", ""))
    problems = []
    for name, (shape, dtype) in expected_tensors(config).items():
        if name not in header:
            problems.append(f"{name} missing")
            continue
        found_shape, found_dtype = tuple(header[name]["shape"]), header[name]["dtype"]
        want_dtype = dtype or float_dtype
        if found_shape != shape:
            problems.append(f"{name} has shape {list(found_shape)}, expected {list(shape)}")
        if (want_dtype is None and found_dtype not in SAFETENSORS_DTYPES.values()) or (want_dtype and found_dtype != want_dtype):
            problems.append(f"{name} has dtype {found_dtype}, expected {want_dtype or 'a float dtype'}")
    if problems:
        raise CheckpointFormatError(f"{weights}: " + "; ".join(problems))
    mapping = load_file(weights)
    try:
        check_mapping(mapping["d2t"], mapping["t2d"])
    except ValueError as exc:
        raise CheckpointFormatError(f"{weights}: {exc}") from None


def has_type(value: Any, expected: type | tuple[type, ...]) -> bool:
    """isinstance, except that JSON true/false is no number and a number no boolean."""
    return isinstance(value, expected) and isinstance(value, bool) == (expected is bool)


def check_config(path: Path, config: dict[str, Any]) -> None:
    """The fields the engines and draftline read, with the types and values they need."""
    problems = [f"{key} missing" for key in CONFIG_TYPES if key not in config]
    problems += [f"{key} is {type(config[key]).__name__}, expected {expected}"
                 for key, expected in CONFIG_TYPES.items() if key in config and not has_type(config[key], expected)]
    if problems:
        raise CheckpointFormatError(f"{path / CONFIG_FILE}: " + "; ".join(problems))
    ids = config["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    rules = [
        (config["architectures"] == [ARCHITECTURE], f"architectures must be [{ARCHITECTURE!r}]"),
        (config["model_type"] == "llama", "model_type must be 'llama'"),
        (config["num_hidden_layers"] == 1, "num_hidden_layers must be 1"),
        (config["tie_word_embeddings"] is False, "tie_word_embeddings must be false"),
        (config.get("norm_before_residual", False) is False, "norm_before_residual must be false (the drafter's residual is un-normed)"),
        (config["draft_vocab_size"] <= config["vocab_size"], "draft_vocab_size exceeds vocab_size"),
        (config["eagle_config"].get("use_aux_hidden_state") is True, "eagle_config.use_aux_hidden_state must be true"),
        (isinstance(ids, list) and len(ids) == 3 and all(isinstance(i, int) for i in ids), "eagle_config needs three layer ids"),
        (config["draftline"].get("layer_convention") == eagle3.LAYER_CONVENTION,
         f"draftline.layer_convention must be {eagle3.LAYER_CONVENTION!r}"),
        (config["draftline"].get("layer_ids") == ids, "draftline.layer_ids differ from eagle_config's"),
        (isinstance(ids, list) and config.get("eagle_aux_hidden_state_layer_ids") == vllm_layer_ids(ids),
         "top-level eagle_aux_hidden_state_layer_ids must be eagle_config's plus one (vLLM counts layer inputs)"),
    ]
    problems = [message for ok, message in rules if not ok]
    if problems:
        raise CheckpointFormatError(f"{path / CONFIG_FILE}: " + "; ".join(problems))


def verify_export(path: Path) -> dict[str, Any]:
    """Raise CheckpointFormatError unless ``path`` holds a complete draftline export; return its config."""
    path = Path(path)
    config = read_config(path)
    check_config(path, config)
    check_tensors(path, config)
    return config


# ---- loading back --------------------------------------------------------------------------------

def layer_ids_of(config: dict[str, Any], target_layers: int) -> list[int]:
    """Our ids from a drafter config: draftline's record, else SGLang's field (same convention), else
    vLLM's top-level field (one higher), else the default for the target."""
    if "draftline" in config:
        return list(config["draftline"]["layer_ids"])
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return list(ids)
    if config.get("eagle_aux_hidden_state_layer_ids"):
        return [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    return eagle3.default_layer_ids(target_layers)


def drafter_config_of(config: dict[str, Any], layer_ids: list[int]) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=config["hidden_size"],
        target_hidden_size=config.get("target_hidden_size") or config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        vocab_size=config["vocab_size"],
        draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
        layer_ids=tuple(layer_ids),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=config.get("rope_theta", 10000.0),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
    )


def load_drafter(path: Path, target_dir: Path, *, embed: torch.Tensor | None = None) -> Eagle3Drafter:
    """An exported (or published EAGLE-3) drafter in float32 on the CPU, with the target's embedding.

    Our own exports are verified in full; a published checkpoint needs the same tensors and shapes.
    """
    path = Path(path)
    config = read_config(path)
    if "draftline" in config:
        check_config(path, config)
    check_tensors(path, {**config, "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                         "num_key_value_heads": config.get("num_key_value_heads") or config["num_attention_heads"]})
    target_layers = int(text_config(read_target_config(target_dir))["num_hidden_layers"])
    drafter = Eagle3Drafter(drafter_config_of(config, layer_ids_of(config, target_layers)))
    weights = {k: v.float() if v.is_floating_point() else v for k, v in load_file(path / WEIGHTS_FILE).items()}
    weights.pop("embed_tokens.weight", None)  # a published drafter may carry its own copy; ours is the target's
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not m.startswith("embed_tokens.")]
    if missing or unexpected:
        raise CheckpointFormatError(f"{path}: missing {missing}, unexpected {unexpected}")
    drafter.load_embedding(load_target_head(target_dir).embed if embed is None else embed)
    return drafter
