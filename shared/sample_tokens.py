"""Token ids and loss mask of one sample, as extraction writes its file and an online trainer plans its batches.

A reply record (``generated/<id>.json``) becomes ``(input_ids, loss_mask)`` here alone, so the lengths an online
trainer plans its batches with and counts its draft vocabulary from are those of the files extraction writes.

The prompt is rendered with ``add_generation_prompt=True``: exactly what the target saw when it replied
(the built-in server, vLLM and SGLang render it so, then tokenize the text without adding specials).
The drafter learns the tokens the target wrote after it, and nothing else.

**Template path** (the usual one). The whole conversation is rendered with the reply appended as an
assistant message (``reasoning_content`` included, which thinking templates such as Qwen3's render as
``<think>…</think>``). Its ids must extend the prompt's (else ``ChatTemplateError``). The mask covers
the ids after the prompt through the reply's end-of-turn token, the one the template closes an
assistant turn with (``shared.chat_turns``: ``<|im_end|>``, ``<|eot_id|>``, ``<｜end▁of▁sentence｜>``),
which is not always the tokenizer's eos; what the template appends after it (ChatML's ``\\n``) is not
learned.

**Explicit path** (the template drops the reasoning). Some templates never show reasoning of a finished
turn: DeepSeek-R1's cuts everything before ``</think>`` and its prompt ends in ``<think>\\n``, Kimi-K2-
Thinking's renders the last assistant turn with an empty ``<think></think>``. They drop it because old
reasoning is not shown back to the model in later turns; the target still wrote it after this very
prompt, so a sample without it would teach the drafter replies the target never gives. The sample is
then the prompt's ids followed by the reply as the target wrote it: ``<think>`` (unless the prompt
already opened it) + reasoning + ``</think>`` + content, tokenized on their own as the target produced
them, and the end-of-turn token. The fields are joined without added whitespace: the built-in server's
and vLLM's reasoning parsers split the text at ``</think>`` and keep every character, so joining them
gives back the target's text exactly, where a canonical ``<think>\n{reasoning}\n</think>\n\n`` would
double the newlines those fields already hold (and Kimi writes none). After a prompt that opened the
think block, an empty reasoning still gets its ``</think>``: the target must close the block to answer.
Reasoning a server without a parser left in the content (``…</think>answer``) is split off first, the
same way, so both kinds of reply record give one sample.

The explicit path refuses (``ReasoningNotRendered``) where it would invent tokens: a vocabulary without
``</think>`` (the reasoning came in another format, which this code cannot rebuild), or a prompt that
already closes the think block (the target was told not to think, yet reasoning is recorded).

**Engine path** (the reply record carries the engine's own token ids: the built-in server and vLLM
return them when asked, ``return_token_ids``). The sample is the engine's prompt ids followed by the ids
it generated, exactly: nothing is rendered or re-tokenized, so no template quirk, BPE merge across the
reply's boundary or dropped reasoning can make the drafter learn tokens the target never produced. The
generated ids already hold the thinking and, for a reply that stopped, the end-of-turn token the target
chose; a reply cut at ``max_tokens`` simply has none.

``{% generation %}`` markers (``return_assistant_tokens_mask``) are not used: few real templates have
them and they disagree on whether the end-of-turn token is inside. Tests use them as an oracle where the
template has them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError

from shared.atomic import read_json
from shared.chat_turns import THINK_CLOSE, THINK_OPEN, TurnEnd, assistant_message, find_turn_end
from shared.errors import ChatTemplateError, DraftlineError, PromptTooLong, ReasoningNotRendered


def render_text(tokenizer, messages: list[dict], *, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    except (TemplateError, ValueError, TypeError) as exc:
        raise ChatTemplateError(
            f"the chat template cannot render this conversation: {type(exc).__name__}: {exc}"
        ) from None


def encode(tokenizer, text: str) -> list[int]:
    """The template writes the special tokens (BOS included) itself, as servers tokenize a rendered prompt."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def reply_end(full_ids: list[int], start: int, end_of_turn: int | None) -> int:
    """Index just past the reply's last end-of-turn token, or the end when the template writes none."""
    if end_of_turn is not None:
        for i in range(len(full_ids) - 1, start - 1, -1):
            if full_ids[i] == end_of_turn:
                return i + 1
    return len(full_ids)


def separate_reasoning(tokenizer, content: str, reasoning: str | None) -> tuple[str, str | None]:
    """``(content, reasoning)``, with reasoning left in the content moved out of it, as a server without a
    reasoning parser returns it: text before ``</think>`` (minus a leading ``<think>``) is the reasoning,
    the split the built-in server and vLLM make, so the explicit path joins it back unchanged."""
    if reasoning or THINK_CLOSE not in content or THINK_CLOSE not in tokenizer.get_vocab():
        return content, reasoning
    head, _, tail = content.partition(THINK_CLOSE)
    return tail, head.removeprefix(THINK_OPEN)


def drops_reasoning(prompt_text: str, full_text: str, reasoning: str | None) -> bool:
    """True when the rendered reply lacks the reasoning the target wrote, or lacks the close of the think
    block the prompt opened (the target must have written ``</think>`` to answer)."""
    reply = full_text[len(os.path.commonprefix([prompt_text, full_text])):]
    if reasoning and reasoning.strip() not in reply:
        return True
    return opens_think(prompt_text) and not full_text.startswith(prompt_text)


def opens_think(prompt_text: str) -> bool:
    return prompt_text.rstrip().endswith(THINK_OPEN)


def explicit_reply(tokenizer, prompt_text: str, content: str, reasoning: str | None) -> str:
    """The reply as the target wrote it after ``prompt_text`` (see the module docstring)."""
    if THINK_CLOSE not in tokenizer.get_vocab():
        raise ReasoningNotRendered(
            "the chat template drops the reply's reasoning and the tokenizer has no </think> token, so the "
            "form in which the target wrote it is unknown"
        )
    if prompt_text.rstrip().endswith(THINK_CLOSE):
        raise ReasoningNotRendered("the prompt closes the think block before the reply, "
                                   "yet the reply records reasoning")
    opener = "" if opens_think(prompt_text) else THINK_OPEN
    return f"{opener}{reasoning or ''}{THINK_CLOSE}{content}"


def check_extends(prefix: list[int], full: list[int]) -> None:
    if full[: len(prefix)] != prefix:
        at = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
        raise ChatTemplateError(
            f"the conversation's tokens do not start with the prompt's "
            f"(first difference at token {at} of {len(prefix)}); "
            "the chat template renders the prompt differently once the reply is appended"
        )


def build_sample(tokenizer, messages: list[dict], reply_content: str, reasoning_content: str | None,
                 max_length: int, *, turn_end: TurnEnd | None = None,
                 finished: bool = True) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)``, truncated to ``max_length``; PromptTooLong when no reply token fits.

    ``turn_end`` is the target's end of turn (``shared.chat_turns.find_turn_end``); callers that build
    many samples pass it once found, else it is found here. A reply cut off at ``max_tokens``
    (``finished=False``) ends where the target stopped: the end-of-turn token the template writes after
    it, and what follows, are left out, since the target never chose to end the turn there.
    """
    turn_end = turn_end if turn_end is not None else find_turn_end(tokenizer)
    reply_content, reasoning_content = separate_reasoning(tokenizer, reply_content, reasoning_content)
    prompt_text = render_text(tokenizer, messages, add_generation_prompt=True)
    prefix = encode(tokenizer, prompt_text)
    if len(prefix) >= max_length:
        raise PromptTooLong(f"prompt is {len(prefix)} tokens; max_length {max_length} leaves no room for the reply")
    full_text = render_text(tokenizer, [*messages, assistant_message(reply_content, reasoning_content)],
                            add_generation_prompt=False)
    if drops_reasoning(prompt_text, full_text, reasoning_content):
        reply = encode(tokenizer, explicit_reply(tokenizer, prompt_text, reply_content, reasoning_content))
        if turn_end.token_id is not None:
            reply.append(turn_end.token_id)
        full, end = prefix + reply, len(prefix) + len(reply)
    else:
        full = encode(tokenizer, full_text)
        check_extends(prefix, full)
        end = reply_end(full, len(prefix), turn_end.token_id)
    if not finished:
        end -= int(turn_end.token_id is not None and end > len(prefix) and full[end - 1] == turn_end.token_id)
        full = full[:end]
    mask = [0] * len(prefix) + [1] * (end - len(prefix)) + [0] * (len(full) - end)
    return full[:max_length], mask[:max_length]


def engine_sample(prompt_ids: list[int], reply_ids: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` from the engine's own ids, truncated to ``max_length``; PromptTooLong
    when no reply token fits."""
    if len(prompt_ids) >= max_length:
        raise PromptTooLong(f"prompt is {len(prompt_ids)} tokens; max_length {max_length} leaves no room for the reply")
    ids = [*prompt_ids, *reply_ids][:max_length]
    return ids, ([0] * len(prompt_ids) + [1] * len(reply_ids))[:max_length]


@dataclass(frozen=True)
class TurnShortfall:
    """An earlier turn whose reply the conversation holds, as the target wrote it, only in part."""

    turn: int  # from 1
    learned: int  # reply tokens learned: those before the first position where the two differ
    tokens: int  # reply tokens the turn has

    def __str__(self) -> str:
        return f"turn {self.turn}: {self.learned} of {self.tokens} reply tokens"


def merge_turns(input_ids: list[int], loss_mask: list[int],
                earlier: list[tuple[list[int], list[int]]]) -> tuple[list[int], list[TurnShortfall]]:
    """The conversation's mask with each earlier turn's reply added, and the turns learned only in part.

    ``input_ids``/``loss_mask`` are the last turn's sample: the whole conversation, the target's earlier
    replies inside its prompt. An earlier turn's sample (its prompt and reply, built as any turn's is) is
    learned at each reply position up to the first where the conversation's ids part from the turn's own:
    there a position sees exactly the context the target answered in and holds exactly what it wrote.
    Where the chat template renders an earlier turn otherwise (a thinking template drops old reasoning) or
    the reply's text does not tokenize back to the ids the target produced (a reply cut by its budget in the
    middle of a character, a token sequence that is not the tokenizer's own split of its text), the rest of
    that reply is left out rather than taught as text the target never wrote in that context. Measured on
    ShareGPT with SmolLM2 (bench/RESULTS.md): 9.5% of two-turn conversations lost their whole first reply
    when one differing token left the turn out. A turn past the conversation's truncation is learned up to it."""
    mask = list(loss_mask)
    shortfalls = []
    for number, (ids, turn_mask) in enumerate(earlier, start=1):
        learned = [i for i, bit in enumerate(turn_mask) if bit]
        same = common_prefix(input_ids, ids)
        for i in learned:
            if i < same:
                mask[i] = 1
        kept = sum(1 for i in learned if i < same)
        # Positions past the conversation's end were cut with it, not lost to a difference.
        if kept < sum(1 for i in learned if i < len(input_ids)):
            shortfalls.append(TurnShortfall(number, kept, len(learned)))
    return mask, shortfalls


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids the two share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class GeneratedFileError(DraftlineError):
    """The reply file of a sample is missing or unreadable."""


def read_reply(path: Path) -> dict:
    """A sample's reply record; GeneratedFileError when it is missing, torn or lacks its prompt."""
    try:
        record = read_json(path)
    except FileNotFoundError:
        raise GeneratedFileError(f"{path}: no reply file (generation did not finish this sample)") from None
    except (OSError, ValueError) as exc:
        raise GeneratedFileError(f"{path}: unreadable reply file ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise GeneratedFileError(f"{path}: reply file lacks the prompt messages")
    return record


UNBOUNDED = 1 << 62  # an earlier turn's sample is cut where the whole conversation's is, not on its own


def sample_of(record: dict, tokenizer, turn_end: TurnEnd, max_length: int,
              path: Path) -> tuple[list[int], list[int], list[TurnShortfall]]:
    """``(input_ids, loss_mask, turns left out)`` of a reply record, cut to ``max_length``.

    A single turn is its own sample. A conversation the target wrote turn by turn is its last turn's
    sample, with each earlier reply learned where the conversation holds it as written
    (``merge_turns``), cut once every turn is in: a conversation longer than ``max_length``
    keeps its first turns, and fails (PromptTooLong) only when no reply token fits."""
    earlier = _earlier_turns(record, path)
    if not earlier:
        return (*turn_sample(record, tokenizer, turn_end, max_length, path), [])
    input_ids, loss_mask = turn_sample(record, tokenizer, turn_end, UNBOUNDED, path)
    samples = [turn_sample(turn, tokenizer, turn_end, UNBOUNDED, path) for turn in earlier]
    loss_mask, unlearned = merge_turns(input_ids, loss_mask, samples)
    input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    if not any(loss_mask):
        raise PromptTooLong(f"no reply token of the conversation's {len(earlier) + 1} turns fits in "
                            f"max_length {max_length}")
    return input_ids, loss_mask, unlearned


def _earlier_turns(record: dict, path: Path) -> list[dict]:
    """The turns before the last of a record regenerated turn by turn (none for a single turn)."""
    turns = record.get("turns")
    if turns is None:
        return []
    if not isinstance(turns, list) or not all(isinstance(t, dict) and isinstance(t.get("messages"), list)
                                              for t in turns):
        raise GeneratedFileError(f"{path}: turns is not a list of turn records with their messages")
    return turns[:-1]


def turn_sample(turn: dict, tokenizer, turn_end: TurnEnd, max_length: int,
                path: Path) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of one turn's record (``messages``, ``reply``, ``finish_reason`` and, from
    an engine that returns them, ``token_ids``): the engine's own ids where the record has them, else the
    chat template's rendering (see the module doc)."""
    engine = engine_ids(turn, path)
    if engine is not None:  # the ids the engine ran: nothing to render or re-tokenize
        return engine_sample(*engine, max_length)
    reply = turn.get("reply") or {}
    return build_sample(tokenizer, turn["messages"], reply.get("content") or "", reply.get("reasoning_content"),
                        max_length, turn_end=turn_end, finished=turn.get("finish_reason") != "length")


def engine_ids(record: dict, path: Path) -> tuple[list[int], list[int]] | None:
    """The engine's (prompt ids, reply ids) of a reply record, None where the server returned none."""
    ids = record.get("token_ids")
    if ids is None:
        return None
    if not isinstance(ids, dict) or not all(
            isinstance(ids.get(k), list) and all(type(t) is int and t >= 0 for t in ids[k]) for k in ("prompt", "reply")):
        raise GeneratedFileError(f"{path}: token_ids is not {{'prompt': [ids], 'reply': [ids]}}")
    if not ids["prompt"] or not ids["reply"]:
        raise GeneratedFileError(f"{path}: token_ids has an empty prompt or reply")
    return ids["prompt"], ids["reply"]


def generation_eos(model_dir: Path) -> int | list[int] | None:
    """``eos_token_id`` of ``generation_config.json`` (an int or a list), None where it names none."""
    try:
        return read_json(model_dir / "generation_config.json").get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return None


def target_turn_end(tokenizer, model_dir: Path) -> TurnEnd:
    """The target's end-of-turn token, from its chat template and its generation config's eos ids."""
    return find_turn_end(tokenizer, eos_ids=generation_eos(model_dir))
