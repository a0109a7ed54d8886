"""A tiny Llama-architecture target, built locally so the demo and the tests need no model hub.

It has everything a real target directory has: ``config.json``, safetensors weights, a byte-level BPE
tokenizer trained here with the ``tokenizers`` library, ``generation_config.json`` and a chat template
that separates reasoning (``<think>…</think>``) and marks assistant tokens with ``{% generation %}``.
"""

from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path

log = logging.getLogger(__name__)

BOS = "<|begin_of_text|>"
PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# The assistant turn renders as "<|im_start|>assistant\n" + reply + "<|im_end|>\n"; the generation
# markers cover reply + "<|im_end|>", exactly the tokens the drafter must learn to predict.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}"
    "{%- if message.get('reasoning_content') -%}"
    "{{- '<think>' + message['reasoning_content'] + '</think>' -}}"
    "{%- endif -%}"
    "{{- message['content'] + '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

EXTRA_CORPUS = """
The quick brown fox jumps over the lazy dog. A drafter proposes tokens and the target verifies them.
Speculative decoding keeps the target's output exactly while reading several tokens per step.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in answers; so do lists, code and punctuation: ()[]{}<>,.;:!?'"-+=*/.
def add(a, b):\n    return a + b\nfor i in range(10):\n    print(i)\n
"""


# What the tiny target is taught to answer, by the form of the question: a short reasoning part and a
# formulaic reply, so its greedy output is text a drafter can learn, as with a real model's habits.
LESSONS = (
    ("bullet", "Three points, short.", "Sure, here are three points:\n- It is simple.\n- It is useful.\n- It is worth learning."),
    ("misconception", "Name the myth, then the fact.", "The most common misconception is that it is hard. In fact, it is easy to learn step by step."),
    ("", "Explain it simply.", "Sure! Think of it like a game: you try, you learn, and you get better every time."),
)


def _corpus() -> list[str]:
    text = resources.files("shared").joinpath("data/demo_prompts.jsonl").read_text(encoding="utf-8")
    lines = [json.dumps(json.loads(line)) for line in text.splitlines() if line.strip()]
    return lines + EXTRA_CORPUS.splitlines()


def build_tokenizer(vocab_size: int):
    """Train a byte-level BPE on the shipped prompts; wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=IM_END, pad_token=PAD, chat_template=CHAT_TEMPLATE
    )
    fast.add_tokens([THINK_OPEN, THINK_CLOSE])  # ordinary (non-special) so decoding keeps them
    return fast


def make_tiny_model(
    out_dir: Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 64,
    num_layers: int = 8,
    seed: int = 0,
    teach_steps: int = 150,
) -> Path:
    """Write a tiny target into ``out_dir`` and return it; loadable with ``from_pretrained(out_dir)``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a build inside `make demo` prints its own one line

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # One thread: a model this small gains nothing from more, and beside other busy processes OpenMP's
    # spinning threads made the build take over 17 minutes on 2 cores instead of 1.5 (and one thread
    # gives the same weights on every machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _teach(model, tokenizer, steps=teach_steps)
    finally:
        torch.set_num_threads(threads)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    log.info("tiny target written to %s (%d layers, hidden %d, vocab %d)", out_dir, num_layers, hidden_size, len(tokenizer))
    return out_dir


def _lesson_for(question: str) -> tuple[str, str]:
    for keyword, reasoning, reply in LESSONS:
        if keyword in question.lower():
            return reasoning, reply
    return LESSONS[-1][1], LESSONS[-1][2]


def _teach(model, tokenizer, *, steps: int, batch_size: int = 32, lr: float = 3e-3) -> None:
    """A few hundred CPU steps of next-token training on chat-formatted (prompt, lesson reply) pairs."""
    import torch

    if steps <= 0:
        return

    text = resources.files("shared").joinpath("data/demo_prompts.jsonl").read_text(encoding="utf-8")
    sequences = []
    for line in text.splitlines():
        row = json.loads(line)
        question = row.get("prompt") or (row.get("messages") or [{}])[-1].get("content") or row["conversations"][-1]["value"]
        reasoning, reply = _lesson_for(question)
        conversation = [{"role": "user", "content": question}, {"role": "assistant", "content": reply, "reasoning_content": reasoning}]
        sequences.append(tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"])
    width = max(len(seq) for seq in sequences)
    ids = torch.full((len(sequences), width), tokenizer.pad_token_id)
    labels = torch.full((len(sequences), width), -100)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, : len(seq)] = torch.tensor(seq)
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        pick = torch.randint(len(sequences), (batch_size,), generator=generator)
        loss = model(input_ids=ids[pick], attention_mask=(labels[pick] != -100).long(), labels=labels[pick]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    log.info("tiny target taught for %d steps (final loss %.3f)", steps, loss.item())


def is_model_dir(path: Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors")) and (path / "tokenizer.json").is_file()
