"""Token ids and loss mask, checked against the tiny template's own ``{% generation %}`` markers.

``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks assistant tokens from the template's
generation blocks: an oracle independent of how ``build_sample`` finds the reply.
"""

from __future__ import annotations

import copy

import pytest

from shared.sample_tokens import build_sample
from shared.chat_turns import assistant_message
from shared.errors import ChatTemplateError, PromptTooLong


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


CONVERSATIONS = {
    "single": [{"role": "user", "content": "Explain a binary search."}],
    "system": [{"role": "system", "content": "You are a concise assistant."},
               {"role": "user", "content": "What is 2 + 2?"}],
    "multi_turn": [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."},
                   {"role": "user", "content": "And another one?"}],
}
REPLIES = [("Eleven is prime, and so is 13.", None),
           ("Four.", "The user asks for a sum; 2 + 2 = 4."),
           ("def add(a, b):\n    return a + b", "Write the function.")]


def oracle(tokenizer, messages, content, reasoning) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template([*messages, assistant_message(content, reasoning)], tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize("reply", REPLIES, ids=["plain", "reasoning", "code_with_reasoning"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_mask_equals_the_templates_generation_markers_for_the_reply(tokenizer, name, reply):
    messages = CONVERSATIONS[name]
    input_ids, loss_mask = build_sample(tokenizer, messages, reply[0], reply[1], max_length=4096)
    expected_ids, expected_mask = oracle(tokenizer, messages, *reply)
    assert input_ids == expected_ids
    prefix = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    # The oracle also marks earlier assistant turns of the prompt; the drafter learns only the new reply.
    assert loss_mask == [0] * prefix + expected_mask[prefix:]
    if name == "multi_turn":
        assert any(expected_mask[:prefix])
    assert sum(loss_mask) > 0


def test_reply_ends_on_the_end_of_turn_token_and_trailing_template_tokens_are_not_learned(tokenizer):
    input_ids, loss_mask = build_sample(tokenizer, CONVERSATIONS["single"], "Yes.", "Hmm.", max_length=4096)
    last = max(i for i, m in enumerate(loss_mask) if m)
    assert input_ids[last] == tokenizer.eos_token_id
    assert last < len(input_ids) - 1 and not any(loss_mask[last + 1:])  # the template's "\n" after <|im_end|>
    text = tokenizer.decode([t for t, m in zip(input_ids, loss_mask) if m])
    assert text == "<think>Hmm.</think>Yes.<|im_end|>"


def test_prompt_that_fills_max_length_is_prompt_too_long(tokenizer):
    messages = CONVERSATIONS["system"]
    prefix = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    with pytest.raises(PromptTooLong, match=f"prompt is {prefix} tokens"):
        build_sample(tokenizer, messages, "Four.", None, max_length=prefix)


def test_long_samples_are_truncated_to_max_length(tokenizer):
    messages = CONVERSATIONS["single"]
    full_ids, _ = build_sample(tokenizer, messages, "A long reply " * 20, None, max_length=4096)
    prefix = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    input_ids, loss_mask = build_sample(tokenizer, messages, "A long reply " * 20, None, max_length=prefix + 3)
    assert input_ids == full_ids[: prefix + 3]
    assert loss_mask == [0] * prefix + [1, 1, 1]


def test_template_that_renders_the_prompt_differently_is_a_chat_template_error(tokenizer):
    odd = copy.deepcopy(tokenizer)
    # The generation prompt opens "assistant", but a finished assistant turn opens "model".
    odd.chat_template = (
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'assistant' -%}{{- '<|im_start|>model\\n' + m['content'] + '<|im_end|>\\n' -}}"
        "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    with pytest.raises(ChatTemplateError, match="do not start with the prompt's"):
        build_sample(odd, CONVERSATIONS["single"], "Yes.", None, max_length=4096)


def test_template_that_refuses_the_conversation_is_a_chat_template_error(tokenizer):
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = "{{- raise_exception('Conversation roles must alternate user/assistant') -}}"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        build_sample(strict, CONVERSATIONS["single"], "Yes.", None, max_length=4096)
