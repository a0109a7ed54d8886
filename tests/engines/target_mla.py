"""A tiny random Kimi-K2-shaped target (``DeepseekV3ForCausalLM``: MLA attention, MoE MLPs) that vLLM's
CPU backend serves, built once and kept across test runs.

What the CPU backend accepts decides the shape:

- attention: vLLM picks its reference CPU MLA backend for any config with ``kv_lora_rank``; its decode
  kernel works on the latent cache, whose row is ``kv_lora_rank + qk_rope_head_dim`` wide, and is built
  for 576 only, so ``kv_lora_rank`` is 512 and ``qk_rope_head_dim`` 64 (Kimi-K2's and DeepSeek-V3's own
  values). The prefill runs in plain PyTorch and takes any ``qk_nope_head_dim`` / ``v_head_dim`` /
  head count; 4 heads of nope 32 and v 32 keep the up-projections small. ``q_lora_rank`` is set
  (Kimi-K2 has one), so the query takes the low-rank path the real model takes.
- MoE: the CPU fused-MoE kernel wants hidden and expert intermediate sizes divisible by 32 and, on
  x86 with AMX or on ARM, bf16 activations; the checkpoint is saved in bf16 and served in bf16.
- routing: ``topk_method`` "noaux_tc" and ``scoring_func`` "sigmoid" are written into the config for
  vLLM (transformers' model hard-codes that routing and does not write them).
- layer 0 is dense (``first_k_dense_replace`` 1), layers 1-3 are MoE with 4 routed experts, 2 per token,
  one shared expert, sigmoid scores with the correction bias, one expert group (Kimi-K2's routing).

The weights are transformers' own init (0.02) except two. The router's weights are drawn wider (0.2) so
its scores spread and a token's expert choice is rarely a near tie. The lm_head is drawn wider (0.5) so
the target's next-token distributions are peaked (at 0.02 they are nearly uniform, and a drafter has
nothing to learn from them). Attention stays at 0.02: wider, its logits grow so large that softmax is
near one-hot, and bf16 rounding then picks other keys (tried at 0.2: vLLM and transformers disagreed by
the states' own size from the third token on).

The tokenizer and chat template are the tiny target's. The entry is keyed by this file and the tiny
target's key, built in a temp directory, renamed into place under a lock, and carries a manifest checked
on every load (as tiny64's does).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.support import tiny_target

MODEL_NAME = "tiny-mla"
NUM_LAYERS = 4
HIDDEN = 128
HEADS = 4
V_HEAD_DIM = 32
ROUTER_STD = 0.2
LM_HEAD_STD = 0.5


def entry_for(root: Path | None = None) -> Path:
    digest = hashlib.sha256(Path(__file__).read_bytes() + tiny_target.cache_key().encode()).hexdigest()[:16]
    return (Path(root) if root is not None else tiny_target.cache_root()) / f"tiny-mla-{digest}"


def config_fields(tokenizer) -> dict:
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": HIDDEN,
        "intermediate_size": 256,  # the dense layer 0
        "moe_intermediate_size": 64,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,  # what DeepseekV3Config and Kimi-K2 write: one latent, expanded per head
        "kv_lora_rank": 512,
        "q_lora_rank": 64,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": V_HEAD_DIM,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        # transformers' DeepseekV3 always routes by sigmoid scores plus the correction bias and writes
        # neither field; vLLM reads them (its defaults: softmax, and no bias parameter to load into), and
        # Kimi-K2's config.json carries both.
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "num_mtp_layers": 0,  # no MTP weights are saved; a config claiming one would send loaders looking
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def build(out_dir: Path, tokenizer_dir: Path) -> Path:
    import torch
    from transformers import (
        AutoTokenizer,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        GenerationConfig,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = DeepseekV3Config(**config_fields(tokenizer))
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, LM_HEAD_STD)
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.weight.normal_(0.0, ROUTER_STD)
            # transformers zeroes the router's correction bias; a trained one is not zero
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def cached_tiny_mla(root: Path | None = None) -> Path:
    entry = entry_for(root)
    return tiny_target.cached_model(entry, MODEL_NAME,
                                    lambda out: build(out, tiny_target.cached_tiny_model(entry.parent)))
