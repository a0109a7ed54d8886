"""A tiny random Llama that vLLM's CPU backend serves, built once and kept across test runs.

vLLM's CPU attention refuses the project's tiny target (head_dim 16) and takes head_dim 64. This
model has the tiny target's tokenizer and chat template (so prompts render the same way) around 4
layers with head_dim 64. vLLM starts with it in 29-55 s on a busy 2-core machine,
as fast as with SmolLM2 (start-up is vLLM's own), but it replies about ten times faster (24 tokens in
0.2-0.9 s against 32 in 3.9 s) and needs no 540 MB conversion. (vLLM starts with the tiny target too,
then its engine dies at the first request: "Unsupported CPU attention configuration: head_dim=16".)

Its weights are random, drawn with a wide initializer (0.2 instead of 0.02) so the logits spread and a
greedy decode has clear winners: a near tie could otherwise fall either way between vLLM's kernels and
transformers', and the tests compare the two token for token.

The entry is keyed by this file and the tiny target's key, built in a temp directory, renamed into
place under a lock, and carries a manifest checked on every load (as the tiny target's does).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.support import tiny_target

MODEL_NAME = "tiny64"
NUM_LAYERS = 4
# What the test server (tests/engines/conftest.py) runs it with. The layers whose states every request
# saves: the embeddings (0), a middle layer, and the last decoder layer (L), before the final norm.
LAYER_IDS = (0, 2, NUM_LAYERS)
# Prefill chunks of 256 tokens, so a prompt of a few hundred tokens is prefilled in several steps, as
# long samples are on a real server (the default here is the model's whole context, 2048).
CHUNK_TOKENS = 256


def entry_for(root: Path | None = None) -> Path:
    digest = hashlib.sha256(Path(__file__).read_bytes() + tiny_target.cache_key().encode()).hexdigest()[:16]
    return (Path(root) if root is not None else tiny_target.cache_root()) / f"tiny64-{digest}"


def build(out_dir: Path, tokenizer_dir: Path) -> Path:
    import torch
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def cached_tiny64(root: Path | None = None) -> Path:
    entry = entry_for(root)
    return tiny_target.cached_model(entry, MODEL_NAME,
                                    lambda out: build(out, tiny_target.cached_tiny_model(entry.parent)))
