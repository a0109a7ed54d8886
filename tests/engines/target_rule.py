"""A tiny target whose greedy replies a drafter can learn, that vLLM's CPU backend serves; built once and kept
across test runs.

tiny64's random weights answer chaotically: a drafter trained on a hundred of its replies reaches an
acceptance length of 1.00, so nothing measured on it can show a good export apart from a broken one. This
target speaks a small rule language instead. Its words are ``ALPHABET`` (16 whole-word tokens of the tiny
target's tokenizer); a sentence starts with any two words and every next word is ``RULE[previous two]``, a
fixed random table. Asked for a sentence's continuation (the user's message is a sentence), it replies with
the sentence continued by the rule, never stopping on its own.

The next word depends on the last two, so a drafter must read the target's hidden states (the word before
the newest comes only from them) to propose well: with the wrong layers, or another run's vocabulary
mapping, it cannot. Teaching takes a few hundred steps and leaves a margin of several logits at every
step, so vLLM's kernels and transformers' pick the same words; the build checks greedy decodes of fresh
sentences against the rule and refuses a model that strays.

Shape and tokenizer are tiny64's (head_dim 64, what the CPU attention takes; the tiny target's template), with
one more layer.
The entry is keyed by this file and the tiny target's key, built in a temp directory, renamed into place
under a lock, and carries a manifest checked on every load.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from tests.support import tiny_target

MODEL_NAME = "tiny-rule"
NUM_LAYERS = 5  # aux layers up to 3 (the last, 4, is no auxiliary layer), so [1, 2, 3] can be shifted down
ALPHABET = (" the", " about", " are", " point", " three", " most", " short", " points", " bullet", " common",
            " and", " list", " numbers", " moon", " cycle", " system")
SEED = 7
PROMPT_WORDS = 8  # words of the user's sentence
TAUGHT_WORDS = 48  # words of a taught reply; tests ask for fewer
TEACH_STEPS = 600
TEACH_BATCH = 64  # sentences a step, drawn from the one per pair of words
TEACH_LR = 3e-3  # with a cosine decay: every word right after about 400 steps (seen: 1e-2 stalls near 90%)
CHECK_SENTENCES = 16
MIN_MARGIN_LOGITS = 2.0  # between the rule's word and the next best, at every checked step


class RuleTargetBuildError(RuntimeError):
    """The taught model strays from the rule, or picks its words by too thin a margin."""


def rule_table(seed: int = SEED) -> list[list[int]]:
    """``table[a][b]``: the index of the word after words ``a``, ``b``."""
    rng = random.Random(seed)
    size = len(ALPHABET)
    return [[rng.randrange(size) for _ in range(size)] for _ in range(size)]


RULE = rule_table()


def continue_words(words: list[int], count: int) -> list[int]:
    """``count`` more word indices after ``words`` (at least two), by the rule."""
    out = list(words)
    for _ in range(count):
        out.append(RULE[out[-2]][out[-1]])
    return out[len(words):]


def sentence(rng: random.Random, length: int = PROMPT_WORDS) -> list[int]:
    """A sentence of ``length`` word indices: two random words, then the rule."""
    start = [rng.randrange(len(ALPHABET)), rng.randrange(len(ALPHABET))]
    return start + continue_words(start, length - 2)


def text_of(words: list[int]) -> str:
    return "".join(ALPHABET[i] for i in words)


def messages_of(words: list[int]) -> list[dict]:
    return [{"role": "user", "content": text_of(words)}]


def prompts(count: int, seed: int) -> list[list[dict]]:
    """``count`` chat prompts, each a sentence of its own (seeded: a test's sets are the same every run)."""
    rng = random.Random(seed)
    return [messages_of(sentence(rng)) for _ in range(count)]


def word_ids(tokenizer) -> list[int]:
    """Each word's token id; a word the tokenizer does not hold as one token fails the build."""
    ids = []
    for word in ALPHABET:
        encoded = tokenizer.encode(word, add_special_tokens=False)
        if len(encoded) != 1:
            raise RuleTargetBuildError(f"{word!r} is {encoded} in the tokenizer, not one token")
        ids.append(encoded[0])
    return ids


def prompt_ids(tokenizer, words: list[int]) -> list[int]:
    ids = list(tokenizer.apply_chat_template(messages_of(words), add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])
    expected = [word_ids(tokenizer)[i] for i in words]
    if not any(ids[s:s + len(expected)] == expected for s in range(len(ids))):
        raise RuleTargetBuildError(f"{text_of(words)!r} does not tokenize word by word")
    return ids


def teach(model, tokenizer) -> None:
    """Next-token training on the sentence and its continuation (the template's tokens are not taught)."""
    import torch

    ids_of = word_ids(tokenizer)
    rows, labels = [], []
    # A sentence from every pair of words: each entry of the rule is taught at least once, where it starts a
    # sentence (random starts leave a third of them to chance, and a fresh sentence starting there strays).
    size = len(ALPHABET)
    for a, b in ((a, b) for a in range(size) for b in range(size)):
        words = [a, b] + continue_words([a, b], PROMPT_WORDS - 2)
        prompt = prompt_ids(tokenizer, words)
        reply = [ids_of[i] for i in continue_words(words, TAUGHT_WORDS)]
        rows.append(prompt + reply)
        start = prompt.index(ids_of[words[0]])  # the first word; what precedes it is the template
        labels.append([-100] * (start + 2) + prompt[start + 2:start + PROMPT_WORDS] + [-100] * (len(prompt) - start - PROMPT_WORDS) + reply)
    width = max(map(len, rows))
    ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])
    target = torch.tensor([row + [-100] * (width - len(row)) for row in labels])
    attention = (torch.arange(width) < torch.tensor([len(r) for r in rows])[:, None]).long()
    optimizer = torch.optim.AdamW(model.parameters(), lr=TEACH_LR)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, TEACH_STEPS)
    model.train()
    order = torch.Generator().manual_seed(SEED)
    for _ in range(TEACH_STEPS):
        batch = torch.randperm(len(rows), generator=order)[:TEACH_BATCH]
        loss = model(input_ids=ids[batch], attention_mask=attention[batch], labels=target[batch]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()


def check_replies(model, tokenizer) -> None:
    """Greedy decodes of fresh sentences follow the rule, each step by at least ``MIN_MARGIN_LOGITS``."""
    import torch

    rng = random.Random(SEED + 2)
    ids_of = word_ids(tokenizer)
    for _ in range(CHECK_SENTENCES):
        words = sentence(rng)
        prompt = prompt_ids(tokenizer, words)
        expected = [ids_of[i] for i in continue_words(words, TAUGHT_WORDS)]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + expected])).logits[0, len(prompt) - 1:-1]  # (words, vocab)
        top = logits.topk(2, dim=-1)
        chosen = top.indices[:, 0].tolist()
        if chosen != expected:
            raise RuleTargetBuildError(f"{text_of(words)!r}: the taught model strays from the rule")
        margin = float((top.values[:, 0] - top.values[:, 1]).min())
        if margin < MIN_MARGIN_LOGITS:
            raise RuleTargetBuildError(f"{text_of(words)!r}: a margin of only {margin:.2f} logits")


def build(out_dir: Path, tokenizer_dir: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
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


def entry_for(root: Path | None = None) -> Path:
    digest = hashlib.sha256(Path(__file__).read_bytes() + tiny_target.cache_key().encode()).hexdigest()[:16]
    return (Path(root) if root is not None else tiny_target.cache_root()) / f"tiny-rule-{digest}"


def cached_tiny_rule(root: Path | None = None) -> Path:
    entry = entry_for(root)
    return tiny_target.cached_model(entry, MODEL_NAME,
                                    lambda out: build(out, tiny_target.cached_tiny_model(entry.parent)))
