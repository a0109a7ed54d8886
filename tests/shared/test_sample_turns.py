"""A conversation the target wrote turn by turn becomes one sample whose loss mask holds every reply, checked
against the tiny template's own ``{% generation %}`` markers, which mark every assistant turn."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.sample_tokens import UNBOUNDED, sample_of, turn_sample
from shared.sample_tokens import merge_turns
from shared.chat_turns import assistant_message, find_turn_end
from shared.errors import PromptTooLong

PATH = Path("generated/00000000.json")
USER1 = {"role": "user", "content": "Name a prime."}
USER2 = {"role": "user", "content": "And another one?"}
REPLY1, REPLY2 = "Seven is prime.", "Eleven is prime too."


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def turns_record(first: str = REPLY1) -> list[dict]:
    """Two turns as the generate job records them, from a server that returns no token ids."""
    first_turn = {"messages": [USER1], "reply": {"content": first, "reasoning_content": None}, "finish_reason": "stop"}
    second_turn = {"messages": [USER1, assistant_message(first, None), USER2],
                   "reply": {"content": REPLY2, "reasoning_content": None}, "finish_reason": "stop"}
    return [first_turn, second_turn]


def conversation(tokenizer, turns: list[dict]) -> tuple[list[int], list[int], list]:
    turn_end = find_turn_end(tokenizer)
    ids, mask = turn_sample(turns[-1], tokenizer, turn_end, 4096, PATH)
    earlier = [turn_sample(turn, tokenizer, turn_end, UNBOUNDED, PATH) for turn in turns[:-1]]
    merged, unlearned = merge_turns(ids, mask, earlier)
    return ids, merged, unlearned


def test_every_reply_of_the_conversation_is_learned_as_the_template_marks_it(tokenizer):
    ids, mask, unlearned = conversation(tokenizer, turns_record())
    oracle = tokenizer.apply_chat_template([USER1, assistant_message(REPLY1, None), USER2,
                                            assistant_message(REPLY2, None)],
                                           tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert unlearned == [] and ids == list(oracle["input_ids"])
    assert mask == list(oracle["assistant_masks"])
    learned = tokenizer.decode([token for token, bit in zip(ids, mask) if bit])
    assert learned == f"{REPLY1}<|im_end|>{REPLY2}<|im_end|>"


def test_engine_ids_of_each_turn_are_learned_where_the_next_prompt_holds_them(tokenizer):
    """From a server that returns its ids: each turn's own prompt and reply ids, and a last prompt that holds
    the first turn's exactly (as a ChatML template renders it) is learned at those positions."""
    template_ids, _, _ = conversation(tokenizer, turns_record())
    turns = turns_record()
    for turn in turns:
        prompt = tokenizer.apply_chat_template(turn["messages"], add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
        reply = tokenizer(turn["reply"]["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        turn["token_ids"] = {"prompt": list(prompt), "reply": list(reply)}
    ids, mask, unlearned = conversation(tokenizer, turns)
    assert unlearned == []
    first = turns[0]["token_ids"]
    span = range(len(first["prompt"]), len(first["prompt"]) + len(first["reply"]))
    assert [i for i in range(len(first["prompt"]) + len(first["reply"])) if mask[i]] == list(span)
    assert ids == turns[1]["token_ids"]["prompt"] + turns[1]["token_ids"]["reply"]


def test_a_first_reply_the_conversation_holds_otherwise_is_learned_up_to_where_they_part(tokenizer):
    """The second turn's prompt carries another first reply than the first turn recorded (a template that
    rewrites earlier turns, a reply whose text tokenizes back otherwise): the first reply is learned up to the
    first differing token, where context and token are still exactly the target's; the last turn still is."""
    turn_end = find_turn_end(tokenizer)
    turns = turns_record()
    turns[0]["reply"]["content"] = "Seven, the lucky prime."  # the conversation holds "Seven is prime."
    ids, mask, unlearned = conversation(tokenizer, turns)
    first_ids, first_mask = turn_sample(turns[0], tokenizer, turn_end, UNBOUNDED, PATH)
    start = first_mask.index(1)
    part = next(i for i in range(start, len(first_ids)) if first_ids[i] != ids[i])
    assert tokenizer.decode(first_ids[start:part]) == "Seven"
    (short,) = unlearned
    assert (short.turn, short.learned, short.tokens) == (1, part - start, sum(first_mask))
    assert str(short) == f"turn 1: {part - start} of {sum(first_mask)} reply tokens"
    learned = tokenizer.decode([token for token, bit in zip(ids, mask) if bit])
    assert learned == f"Seven{REPLY2}<|im_end|>"
    # A first reply that differs from its first token on is not learned at all.
    turns[0]["reply"]["content"] = "Eleven, the lucky prime."
    _, mask, unlearned = conversation(tokenizer, turns)
    assert [(s.turn, s.learned) for s in unlearned] == [(1, 0)]
    assert tokenizer.decode([token for token, bit in zip(ids, mask) if bit]) == f"{REPLY2}<|im_end|>"


def test_a_conversation_longer_than_max_length_keeps_its_first_turns(tokenizer):
    turn_end = find_turn_end(tokenizer)
    turns = turns_record()
    record = {**turns[-1], "turns": turns}
    _, first_mask = turn_sample(turns[0], tokenizer, turn_end, UNBOUNDED, PATH)
    cut = first_mask.index(1) + 2  # two tokens into the first reply: the last turn's prompt does not fit
    ids, mask, unlearned = sample_of(record, tokenizer, turn_end, cut, PATH)
    assert unlearned == [] and len(ids) == len(mask) == cut and sum(mask) == 2
    with pytest.raises(PromptTooLong, match="no reply token of the conversation's 2 turns fits in max_length"):
        sample_of(record, tokenizer, turn_end, first_mask.index(1), PATH)
