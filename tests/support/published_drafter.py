"""Published-layout EAGLE-3 drafters for a local target, written without the hub.

The config has the fields of the drafters people publish for vLLM and SGLang (SpecForge's exports, the
AQ-MedAI and yuhuili drafters): ``LlamaForCausalLMEagle3``, no ``draftline`` block, ``rope_scaling`` and
``rope_theta`` at the top level, the layer ids in one engine's field or in none. The weights are bf16
safetensors under the names the engines load (``midlayer.*``, ``fc``, ``norm``, ``lm_head``), with the
drafter's own ``embed_tokens`` and, optionally, ``d2t``/``t2d``; shapes are scaled to the target's.

The mapping is deliberately not the one a run's data gives (every third target id from the top), so a
test can tell a kept mapping from a recomputed one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
SGLANG = "sglang"  # eagle_config.eagle_aux_hidden_state_layer_ids: outputs of layers, our convention
VLLM = "vllm"  # top-level eagle_aux_hidden_state_layer_ids: HF hidden-states index (layer output + 1)
BOTH = "both"  # both fields, as an engine-neutral export writes them
NONE = "none"  # no ids: both engines take their default layers


@dataclass(frozen=True)
class Published:
    """One published drafter's shape; ``None`` fields follow the target."""

    convention: str = SGLANG
    layer_ids: list[int] = field(default_factory=lambda: [1, 3, 4])  # layer outputs, our convention
    mapping: tuple[str, ...] = ("d2t", "t2d")  # which mapping tensors the file holds
    rope_scaling: dict[str, Any] | None = field(default_factory=lambda: dict(YARN))
    max_position_embeddings: int = 131072
    draft_vocab_size: int = 128
    hidden_size: int | None = None  # the drafter's width
    target_hidden_size: int | None = None  # written only when set (published configs omit it when equal)
    vocab_size: int | None = None
    seed: int = 0


def target_config(target_dir: Path) -> dict[str, Any]:
    config = json.loads((Path(target_dir) / "config.json").read_text())
    return config.get("text_config") or config


def published_mapping(vocab: int, draft_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every third target id counting down from the top, ascending: ``(d2t int64 [Vd], t2d bool [V])``."""
    chosen = torch.sort(torch.arange(vocab - 1, -1, -3)[:draft_vocab]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return chosen - torch.arange(chosen.numel()), t2d


def published_config(target: dict[str, Any], spec: Published) -> dict[str, Any]:
    hidden = spec.hidden_size or target["hidden_size"]
    heads, kv = target["num_attention_heads"], target.get("num_key_value_heads") or target["num_attention_heads"]
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": target.get("bos_token_id"),
        "draft_vocab_size": spec.draft_vocab_size,
        "eos_token_id": target.get("eos_token_id"),
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": 3 * hidden,
        "max_position_embeddings": spec.max_position_embeddings,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": kv,
        "pad_token_id": target.get("pad_token_id"),
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": spec.rope_scaling,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
        "use_cache": True,
        "vocab_size": spec.vocab_size or target["vocab_size"],
    }
    if spec.target_hidden_size is not None:
        config["target_hidden_size"] = spec.target_hidden_size
    if spec.convention in (SGLANG, BOTH):
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(spec.layer_ids), "use_aux_hidden_state": True}
    if spec.convention in (VLLM, BOTH):
        config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in spec.layer_ids]
    return config


def published_weights(config: dict[str, Any], spec: Published) -> dict[str, torch.Tensor]:
    h, i, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    ht, v, vd = config.get("target_hidden_size") or h, config["vocab_size"], config["draft_vocab_size"]
    shapes = {
        "embed_tokens.weight": (v, h),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (i, h), "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "fc.weight": (h, 3 * ht), "lm_head.weight": (vd, h),
    }
    generator = torch.Generator().manual_seed(spec.seed)
    tensors = {name: (torch.randn(shape, generator=generator) * 0.05).to(torch.bfloat16) for name, shape in shapes.items()}
    for norm in ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                 "midlayer.post_attention_layernorm.weight", "norm.weight"):
        tensors[norm] = (1.0 + 0.1 * torch.randn(h, generator=generator)).to(torch.bfloat16)
    d2t, t2d = published_mapping(v, vd)
    tensors.update({name: tensor for name, tensor in (("d2t", d2t), ("t2d", t2d)) if name in spec.mapping})
    return tensors


def write_published_drafter(out_dir: Path, target_dir: Path, spec: Published = Published()) -> Path:
    """A published-layout drafter for the target in ``target_dir``, written to ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = published_config(target_config(target_dir), spec)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(published_weights(config, spec), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
