"""A tiny thinking target that vLLM's CPU backend serves: Qwen3's tokenizer family and chat template, and a
greedy reply that is a ``<think>`` block followed by the answer, built once and kept across test runs.

The tokenizer is ``tests/support/chat_families.QWEN3``: Qwen3's published chat template, ``<|im_end|>`` as
eos and end of turn, and ``<think>`` / ``</think>`` as single added tokens that are not special (as in
Qwen3's own vocabulary), so a decode with ``skip_special_tokens`` keeps them and a reasoning parser finds
them in the text. The model is a Llama with head_dim 64 (what the CPU attention takes) taught, on exactly
the ``QUESTIONS`` the tests ask, to answer each with ``REPLY``: the template's rendering of ``REASONING``
and ``CONTENT``, ``<think>\\n…\\n</think>\\n\\n…<|im_end|>``, as Qwen3 writes its replies.

Teaching takes a hundred steps (seconds) and leaves a margin of several logits between the taught token
and the next best at every step, so vLLM's kernels and transformers' pick the same tokens. The build
checks transformers' greedy decode of every question against ``REPLY`` and refuses a model that strays.

The entry is keyed by this file, the chat families' file and the tiny target's key (the library
versions), built in a temp directory, renamed into place under a lock, and carries a manifest checked on
every load (as tiny64's does).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.support import chat_families, tiny_target

MODEL_NAME = "tiny-think"
NUM_LAYERS = 4
QUESTIONS = ("What is 2 + 2?", "Give me three bullet points about tea.", "Name a prime.")
REASONING = "The user asks a question. Answer it in one short line."
CONTENT = "Sure: the answer is four."
TEACH_STEPS = 100
MAX_NEW_TOKENS = 64  # far more than the reply's tokens: a reply that does not stop is a wrong one


class ThinkTargetBuildError(RuntimeError):
    """The taught model's greedy reply to a question is not the reply it was taught."""


def entry_for(root: Path | None = None) -> Path:
    sources = Path(__file__).read_bytes() + Path(chat_families.__file__).read_bytes()
    digest = hashlib.sha256(sources + tiny_target.cache_key().encode()).hexdigest()[:16]
    return (Path(root) if root is not None else tiny_target.cache_root()) / f"tiny-think-{digest}"


def conversation(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def prompt_ids(tokenizer, question: str) -> list[int]:
    return list(tokenizer.apply_chat_template(conversation(question), add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def reply_ids(tokenizer, question: str) -> list[int]:
    """The taught reply's ids, through its ``<|im_end|>``: what follows the prompt in the template's rendering
    of the whole conversation."""
    answer = {"role": "assistant", "content": CONTENT, "reasoning_content": REASONING}
    full = list(tokenizer.apply_chat_template([*conversation(question), answer], tokenize=True,
                                              return_dict=True)["input_ids"])
    prompt = prompt_ids(tokenizer, question)
    if full[:len(prompt)] != prompt:
        raise ThinkTargetBuildError(f"{question!r}: the template renders the prompt differently once a reply follows")
    end = full.index(tokenizer.eos_token_id, len(prompt)) + 1
    return full[len(prompt):end]


def teach(model, tokenizer) -> None:
    """Next-token training on the reply positions of every question, in one batch."""
    import torch

    prompts = [prompt_ids(tokenizer, q) for q in QUESTIONS]
    replies = [reply_ids(tokenizer, q) for q in QUESTIONS]
    width = max(len(p) + len(r) for p, r in zip(prompts, replies))
    ids = torch.full((len(QUESTIONS), width), tokenizer.pad_token_id)
    labels = torch.full((len(QUESTIONS), width), -100)
    for row, (prompt, reply) in enumerate(zip(prompts, replies)):
        ids[row, :len(prompt) + len(reply)] = torch.tensor(prompt + reply)
        labels[row, len(prompt):len(prompt) + len(reply)] = torch.tensor(reply)
    lengths = torch.tensor([len(p) + len(r) for p, r in zip(prompts, replies)])
    attention = (torch.arange(width) < lengths[:, None]).long()  # (questions, width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(TEACH_STEPS):
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def check_replies(model, tokenizer) -> None:
    import torch

    for question in QUESTIONS:
        prompt = prompt_ids(tokenizer, question)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        got = out[0, len(prompt):].tolist()
        if got != reply_ids(tokenizer, question):
            raise ThinkTargetBuildError(f"{question!r}: greedy reply {tokenizer.decode(got)!r}, taught "
                                        f"{tokenizer.decode(reply_ids(tokenizer, question))!r}")


def build(out_dir: Path) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    family = chat_families.QWEN3
    tokenizer = family.tokenizer()
    eos_ids = family.generation_eos_ids(tokenizer)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id)
    # One thread: the same weights on every machine, and no OpenMP spinning beside busy processes.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        teach(model, tokenizer)
        check_replies(model, tokenizer)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def cached_tiny_think(root: Path | None = None) -> Path:
    return tiny_target.cached_model(entry_for(root), MODEL_NAME, build)
