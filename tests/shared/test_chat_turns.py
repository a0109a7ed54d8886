"""The end-of-turn token: read from the template where it writes one, else chosen from eos and well-known ids."""

from __future__ import annotations

import pytest

from shared.chat_turns import eos_candidates, find_turn_end
from tests.support.chat_families import FAMILIES, QWEN25, QWEN25_BASE


@pytest.mark.parametrize("family", [pytest.param(f, id=f.name) for f in FAMILIES])
def test_every_family_closes_its_assistant_turn_with_its_own_token(family):
    tokenizer = family.tokenizer()
    turn_end = find_turn_end(tokenizer, family.generation_eos_ids(tokenizer))
    assert (turn_end.token(tokenizer), turn_end.source) == (family.end_of_turn, "template")


def test_eos_candidates_take_generation_configs_int_or_list_then_the_tokenizers():
    tokenizer = QWEN25_BASE.tokenizer()
    eos, im_end = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eos_candidates(tokenizer, None) == [eos]
    assert eos_candidates(tokenizer, im_end) == [im_end, eos]
    assert eos_candidates(tokenizer, [im_end, eos]) == [im_end, eos]


def test_template_that_refuses_the_probe_falls_back_to_a_well_known_end_of_turn_among_the_eos_ids():
    tokenizer = QWEN25.tokenizer()
    tokenizer.chat_template = "{{- raise_exception('Conversation roles must alternate') -}}"
    generation_eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    turn_end = find_turn_end(tokenizer, generation_eos)
    assert (turn_end.token(tokenizer), turn_end.source) == ("<|im_end|>", "well-known")


def test_template_that_closes_turns_with_plain_text_falls_back_to_the_eos():
    tokenizer = QWEN25_BASE.tokenizer()
    tokenizer.chat_template = "{%- for m in messages -%}{{ m['role'] + ': ' + m['content'] + '\\n\\n' }}{%- endfor -%}"
    turn_end = find_turn_end(tokenizer, [tokenizer.eos_token_id])
    assert (turn_end.token(tokenizer), turn_end.source) == ("<|endoftext|>", "eos")


def test_tokenizer_without_template_or_eos_uses_a_well_known_special_of_its_vocabulary():
    tokenizer = QWEN25.tokenizer()
    tokenizer.chat_template = None
    tokenizer.eos_token = None
    turn_end = find_turn_end(tokenizer)
    assert (turn_end.token(tokenizer), turn_end.source) == ("<|im_end|>", "well-known")
