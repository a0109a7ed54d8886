"""The exported DFlash drafter: ``config.json`` + ``model.safetensors`` in the layout vLLM 0.32's
``qwen3_dflash`` loads (``DFlashDraftModel``), written atomically and verified name by name and shape by
shape before it is published; and loading one back for evaluation.

vLLM's loader reports no missing weight (its ``load_weights`` returns None, so the engine's own check is
skipped: docs/dflash.md §2), so a misnamed tensor would be served at its initial value. The exporter
therefore holds the export to the exact set of names and shapes ``expected_tensors`` lists, read from that
loader, and the export carries no key vLLM reads otherwise: no ``eagle_config`` (it would replace the target
layer ids, §4.3) and no ``mask_embedding.pt`` (a pickle file; mask slots read the target's embedding).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from shared import SCHEMA_VERSION, eagle3
from shared.drafter_format import (
    DFLASH_ARCHITECTURE,
    WEIGHTS_FILE,
    check_tensors,
    read_config,
    read_safetensors_header,
    speculative_method,
)
from shared.errors import CheckpointFormatError
from modeling.dflash import METHOD, DFlashConfig, DFlashDrafter
from modeling.export import TORCH_DTYPE_NAMES, drafter_config_of, publish
from modeling.target_head import load_target_head, read_target_config, text_config

log = logging.getLogger(__name__)

ARCHITECTURE = DFLASH_ARCHITECTURE  # a Qwen3ForCausalLM name is not served as a DFlash drafter
FORBIDDEN_KEYS = ("eagle_config", "eagle_aux_hidden_state_layer_ids")  # vLLM would read the target layers from them


def export_config(config: DFlashConfig, *, target_model: str, target_fingerprint: str, dtype: torch.dtype) -> dict[str, Any]:
    c = config.base
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "num_hidden_layers": config.num_layers,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,  # always written: vLLM's default for a missing one is 1e6
        "max_position_embeddings": c.max_position_embeddings,  # the drafter drafts nothing past it
        "attention_bias": False,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": TORCH_DTYPE_NAMES[dtype],
        "block_size": config.block_size,  # informational: vLLM's num_speculative_tokens is block_size - 1
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": list(c.layer_ids),
                          "causal": config.causal},
        "draftline": {
            "schema_version": SCHEMA_VERSION,
            "method": METHOD,
            "layer_convention": eagle3.LAYER_CONVENTION,  # target_layer_ids are vLLM's convention too (§4.3)
            "layer_ids": list(c.layer_ids),
            "target_model": target_model,
            "target_fingerprint": target_fingerprint,
        },
    }
    if c.rope_scaling:
        out["rope_scaling"] = dict(c.rope_scaling)
    return out


def expected_tensors(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """Every tensor name vLLM's qwen3_dflash loads for this config, with its shape (docs/dflash.md §2), plus
    ``t2d``, draftline's own (vLLM skips it); in ``drafter_format.expected_tensors``'s form (dtype None: the
    config's float dtype)."""
    h, hd = config["hidden_size"], config["head_dim"]
    nh, nkv, inter = config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
    layers = len(config["dflash_config"]["target_layer_ids"])
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, layers * config["target_hidden_size"]),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (config["draft_vocab_size"], h),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (nh * hd, h), p + "self_attn.k_proj.weight": (nkv * hd, h),
            p + "self_attn.v_proj.weight": (nkv * hd, h), p + "self_attn.o_proj.weight": (h, nh * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        }
    return {**{name: (shape, None) for name, shape in shapes.items()},
            "d2t": ((config["draft_vocab_size"],), "I64"), "t2d": ((config["vocab_size"],), "BOOL")}


def verify_dflash_export(path: Path) -> dict[str, Any]:
    """The export's config once its names, shapes and dtypes are exactly what vLLM loads (and its d2t/t2d a
    consistent mapping); CheckpointFormatError naming what differs otherwise."""
    path = Path(path)
    config = read_config(path)
    if config.get("architectures") != [ARCHITECTURE]:
        raise CheckpointFormatError(f"{path}: architectures {config.get('architectures')}, vLLM serves DFlash as [{ARCHITECTURE!r}]")
    if found := [key for key in FORBIDDEN_KEYS if key in config]:
        raise CheckpointFormatError(f"{path}: {found} in config.json would make vLLM read other target layers")
    dflash = config.get("dflash_config") or {}
    ids = dflash.get("target_layer_ids")
    if not ids or ids != sorted(set(ids)) or ids != config.get("draftline", {}).get("layer_ids"):
        raise CheckpointFormatError(f"{path}: dflash_config.target_layer_ids {ids} must be the ascending layers trained on "
                                    f"({config.get('draftline', {}).get('layer_ids')})")
    if not 0 <= int(dflash.get("mask_token_id", -1)) < config["vocab_size"]:
        raise CheckpointFormatError(f"{path}: mask_token_id {dflash.get('mask_token_id')} outside the vocabulary")
    expected = expected_tensors(config)
    # A tensor vLLM does not know is a layout it would not read (a fused qkv_proj, another prefix).
    if unexpected := sorted(read_safetensors_header(path / WEIGHTS_FILE).keys() - expected.keys()):
        raise CheckpointFormatError(f"{path}: unexpected tensors {unexpected}")
    check_tensors(path, config, expected=expected)
    return config


def export_dflash(drafter: DFlashDrafter, out_dir: Path, *, target_model: str, target_fingerprint: str,
                  dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the export to a temp directory, verify it, then rename it over ``out_dir``."""
    config = export_config(drafter.config, target_model=target_model, target_fingerprint=target_fingerprint, dtype=dtype)
    publish(out_dir, config, drafter.export_state(), dtype, verify_dflash_export)
    log.info("DFlash drafter exported to %s (%s, %d layers, blocks of %d, target layers %s, mask token %d)", out_dir,
             config["torch_dtype"], drafter.config.num_layers, drafter.config.block_size,
             list(drafter.config.layer_ids), drafter.config.mask_token_id)
    return Path(out_dir)


def is_dflash_export(path: Path) -> bool:
    return speculative_method(read_config(Path(path))) == METHOD


def load_dflash(path: Path, target_dir: Path, *, embed: torch.Tensor | None = None) -> DFlashDrafter:
    """A verified DFlash export in float32 on the CPU, with the target's embedding. Its layers' k_norm weights
    must be one weight (this drafter shares it; an export whose layers differ there is not one of ours)."""
    path = Path(path)
    config = verify_dflash_export(path)
    dflash = config["dflash_config"]
    ids = list(dflash["target_layer_ids"])
    layers = int(text_config(read_target_config(target_dir))["num_hidden_layers"])
    if max(ids) >= layers:
        raise CheckpointFormatError(f"{path}: target_layer_ids {ids} beyond the target's {layers} layers")
    drafter = DFlashDrafter(DFlashConfig(drafter_config_of(config, ids), num_layers=config["num_hidden_layers"],
                                         block_size=int(config.get("block_size", 2)), mask_token_id=int(dflash["mask_token_id"]),
                                         causal=bool(dflash.get("causal", False))))
    weights = {k: v.float() if v.is_floating_point() else v for k, v in load_file(path / WEIGHTS_FILE).items()}
    norms = [weights.pop(f"layers.{i}.self_attn.k_norm.weight") for i in range(drafter.config.num_layers)]
    if any(not torch.equal(norms[0], other) for other in norms[1:]):
        raise CheckpointFormatError(f"{path}: its layers' k_norm weights differ; this drafter shares one")
    weights["k_norm.weight"] = norms[0]
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not m.startswith("embed_tokens.")]
    if missing or unexpected:
        raise CheckpointFormatError(f"{path}: missing {missing}, unexpected {unexpected}")
    drafter.load_embedding(load_target_head(target_dir).embed if embed is None else embed)
    return drafter
