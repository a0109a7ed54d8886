"""Loss masks under the chat templates real targets ship (tests/support/chat_families.py).

For every family the learned tokens are exactly what the target wrote after the prompt, reasoning
included, ending with the family's end-of-turn token, which is not the eos in Llama-3, Qwen2.5 base and
Kimi-K2. None of these templates has ``{% generation %}`` markers, and DeepSeek-R1's and Kimi-K2-Thinking's
drop the reasoning of a finished turn.
"""

from __future__ import annotations

import pytest

from shared.sample_tokens import build_sample
from shared.chat_turns import find_turn_end
from shared.errors import PromptTooLong, ReasoningNotRendered
from tests.shared.test_sample_tokens import CONVERSATIONS
from tests.support.chat_families import DEEPSEEK_R1, FAMILIES, KIMI_K2_THINKING, LLAMA3, QWEN25, QWEN25_BASE, QWEN3

THINKERS = [f for f in FAMILIES if f.thinks]
PLAIN = [f for f in FAMILIES if not f.thinks]


def ids_of(f):
    return [pytest.param(x, id=x.name) for x in f]


def prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def learned(tokenizer, input_ids, loss_mask) -> tuple[str, int, int]:
    """(decoded masked tokens, first masked index, last masked index); the masked span must be one run."""
    where = [i for i, m in enumerate(loss_mask) if m]
    assert where == list(range(where[0], where[-1] + 1))
    return tokenizer.decode(input_ids[where[0]: where[-1] + 1]), where[0], where[-1]


def check_sample(family, messages, content, reasoning):
    tokenizer = family.tokenizer()
    input_ids, loss_mask = build_sample(tokenizer, messages, content, reasoning, max_length=4096)
    prefix = prompt_ids(tokenizer, messages)
    text, first, last = learned(tokenizer, input_ids, loss_mask)
    assert input_ids[:len(prefix)] == prefix and first == len(prefix)  # what the target saw, then its reply
    assert text == family.reply_text(content, reasoning) + family.end_of_turn
    assert input_ids[last] == tokenizer.convert_tokens_to_ids(family.end_of_turn)
    assert tokenizer.decode(input_ids[last + 1:]) == family.trailer  # the template's, not learned
    return tokenizer, input_ids, loss_mask


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("family", ids_of(FAMILIES))
def test_mask_is_exactly_the_reply_and_the_families_end_of_turn(family, name):
    check_sample(family, CONVERSATIONS[name], "Eleven is prime, and so is 13.", None)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("family", ids_of(THINKERS))
def test_reasoning_is_learned_whether_or_not_the_template_renders_it(family, name):
    check_sample(family, CONVERSATIONS[name], "def add(a, b):\n    return a + b", "Write the function.")


@pytest.mark.parametrize("family", ids_of([QWEN3]))
def test_where_the_template_renders_the_reasoning_the_sample_is_the_templates_rendering(family):
    tokenizer = family.tokenizer()
    messages = CONVERSATIONS["system"]
    input_ids, _ = build_sample(tokenizer, messages, "Four.", "2 + 2 = 4.", max_length=4096)
    reply = {"role": "assistant", "content": "Four.", "reasoning_content": "2 + 2 = 4."}
    assert input_ids == tokenizer.apply_chat_template([*messages, reply], tokenize=True, return_dict=False)


def test_deepseek_r1_reply_keeps_the_targets_own_whitespace_after_the_prompts_open_think():
    # vLLM's and the built-in server's parsers split at </think> and keep every character.
    tokenizer = DEEPSEEK_R1.tokenizer()
    messages = CONVERSATIONS["single"]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False).endswith("<think>\n")
    input_ids, loss_mask = build_sample(tokenizer, messages, "\n\nHalve the range.", "Okay, search.\n", max_length=4096)
    text, _, _ = learned(tokenizer, input_ids, loss_mask)
    assert text == "Okay, search.\n</think>\n\nHalve the range.<｜end▁of▁sentence｜>"


@pytest.mark.parametrize("family, content", [pytest.param(QWEN3, "<think>Sum it.</think>Four.", id="qwen3"),
                                             pytest.param(KIMI_K2_THINKING, "<think>Sum it.</think>Four.", id="kimi"),
                                             pytest.param(DEEPSEEK_R1, "Sum it.</think>Four.", id="deepseek-r1")])
def test_reasoning_left_in_the_content_by_a_server_without_a_parser_is_the_same_sample(family, content):
    tokenizer = family.tokenizer()
    messages = CONVERSATIONS["single"]
    unparsed = build_sample(tokenizer, messages, content, None, max_length=4096)
    assert unparsed == build_sample(tokenizer, messages, "Four.", "Sum it.", max_length=4096)


@pytest.mark.parametrize("family", ids_of(PLAIN))
def test_reasoning_for_a_target_without_think_tokens_is_a_named_error(family):
    with pytest.raises(ReasoningNotRendered, match="no </think> token"):
        build_sample(family.tokenizer(), CONVERSATIONS["single"], "Four.", "Sum it.", max_length=4096)


def test_reasoning_after_a_prompt_that_closed_the_think_block_is_a_named_error():
    # DeepSeek-R1's template with thinking switched off in the generation prompt, as Qwen3's
    # enable_thinking=False writes it: the target was not let think, so recorded reasoning is not its own.
    tokenizer = DEEPSEEK_R1.tokenizer()
    opened = "{{'<｜Assistant｜><think>\\n'}}"
    assert opened in tokenizer.chat_template
    tokenizer.chat_template = tokenizer.chat_template.replace(opened, "{{'<｜Assistant｜><think>\\n\\n</think>\\n\\n'}}")
    with pytest.raises(ReasoningNotRendered, match="closes the think block"):
        build_sample(tokenizer, CONVERSATIONS["single"], "Four.", "Sum it.", max_length=4096)


@pytest.mark.parametrize("family", ids_of([LLAMA3, QWEN25_BASE, KIMI_K2_THINKING]))
def test_end_of_turn_is_read_from_the_template_where_eos_differs(family):
    tokenizer = family.tokenizer()
    assert tokenizer.eos_token != family.end_of_turn
    turn_end = find_turn_end(tokenizer, family.generation_eos_ids(tokenizer))
    assert (turn_end.token(tokenizer), turn_end.source) == (family.end_of_turn, "template")


@pytest.mark.parametrize("family", ids_of(FAMILIES))
def test_prompt_that_fills_max_length_is_prompt_too_long_and_longer_samples_are_cut(family):
    tokenizer = family.tokenizer()
    messages = CONVERSATIONS["system"]
    reasoning = "Add them." if family.thinks else None
    prefix = len(prompt_ids(tokenizer, messages))
    with pytest.raises(PromptTooLong, match=f"prompt is {prefix} tokens"):
        build_sample(tokenizer, messages, "Four.", reasoning, max_length=prefix)
    whole, _ = build_sample(tokenizer, messages, "A long reply " * 20, reasoning, max_length=4096)
    input_ids, loss_mask = build_sample(tokenizer, messages, "A long reply " * 20, reasoning, max_length=prefix + 3)
    assert input_ids == whole[: prefix + 3]
    assert loss_mask == [0] * prefix + [1, 1, 1]


def test_chatml_base_tokenizer_does_not_learn_the_newline_after_im_end():
    # eos is <|endoftext|>, which the template never writes: stopping on eos would learn the "\n" too.
    tokenizer, input_ids, loss_mask = check_sample(QWEN25_BASE, CONVERSATIONS["single"], "Yes.", None)
    assert tokenizer.eos_token_id not in input_ids
    assert loss_mask[-1] == 0 and tokenizer.decode(input_ids[-1:]) == "\n"
    assert QWEN25.tokenizer().eos_token == "<|im_end|>"  # the instruct tokenizer's eos is the end of turn


@pytest.mark.parametrize("family", ids_of(FAMILIES))
def test_a_reply_cut_off_at_max_tokens_teaches_no_end_of_turn(family):
    """The target never ended that turn: the sample stops at its last token, with nothing after it."""
    tokenizer = family.tokenizer()
    messages = CONVERSATIONS["single"]
    content = "Eleven is prime, and so is"
    reasoning = "Primes have two divisors." if family.thinks else None
    input_ids, loss_mask = build_sample(tokenizer, messages, content, reasoning, max_length=4096, finished=False)
    prefix = prompt_ids(tokenizer, messages)
    text, first, last = learned(tokenizer, input_ids, loss_mask)
    assert first == len(prefix) and last == len(input_ids) - 1
    assert text == family.reply_text(content, reasoning)
    assert tokenizer.convert_tokens_to_ids(family.end_of_turn) not in input_ids[len(prefix):]
