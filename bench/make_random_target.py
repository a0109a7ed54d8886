"""A random target with a real model's shape (default: Llama-3.1-8B's), for speed benchmarks on a GPU.

    python bench/make_random_target.py OUT_DIR [--layers 32]

Weights are random bf16 made on the GPU; the tokenizer and chat template are the tiny target's. Speed
does not depend on what the weights say, only on their shapes.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from services.cli.tiny_model import make_tiny_model
from shared.settings import configure_logging

log = logging.getLogger("make_random_target")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    args = parser.parse_args()
    configure_logging()
    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model(args.out.parent / "tokenizer-source", teach_steps=0))
    config = LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        dtype="bfloat16",
    )
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    log.info("random target with %d layers written to %s", args.layers, args.out)


if __name__ == "__main__":
    main()
