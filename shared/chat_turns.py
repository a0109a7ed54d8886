"""The token that ends an assistant turn, read from the target's own chat template.

End of sequence and end of turn are different tokens in many families: ChatML targets end a turn with
``<|im_end|>`` while a base tokenizer's eos is ``<|endoftext|>``, Llama-3 ends it with ``<|eot_id|>``
while its eos is ``<|end_of_text|>``, Kimi-K2 with ``<|im_end|>`` while its eos is ``[EOS]``. The
extractor's loss mask must stop on the end of turn (the target writes it and stops; what the template
appends after it is not the target's), and the built-in server must stop decoding there.

How it is found, in order:

1. **The template itself.** A probe conversation (one user message, one assistant reply) is rendered
   with the target's template; the text after the reply's last occurrence is what the template writes
   to close an assistant turn (``<|im_end|>\\n``, ``<|eot_id|>``, ``<｜end▁of▁sentence｜>``,
   ``<end_of_turn>\\n``). Its first special token is the end of turn; whatever follows it (a newline,
   a trailing eos) is the template's, not the target's. This is exact for the template the target was
   served with, whatever the tokenizer's eos says.
2. **Where the probe finds nothing** (the template raises on the probe, or closes a turn with plain
   text only): a well-known end-of-turn special of the vocabulary that is also one of the target's eos
   ids (generation_config's, which may be a list, and the tokenizer's); else the first of those eos ids;
   else any well-known end-of-turn special the vocabulary has; else none.

Only the tokenizer object is used (no torch), so the extractor and the inference server share it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# Specials that close an assistant turn in the families draftline meets: ChatML (Qwen, Kimi), Llama-3,
# DeepSeek, Gemma, Phi-3, gpt-oss (<|return|> ends its final message).
WELL_KNOWN_TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<｜end▁of▁sentence｜>", "<end_of_turn>", "<|end|>", "<|return|>")

_PROBE_USER = "Name a colour."
_PROBE_REPLY = "Teal is a colour."


@dataclass(frozen=True)
class TurnEnd:
    """The id that closes an assistant turn (None where nothing does) and where that answer came from."""

    token_id: int | None
    source: str  # "template", "eos", "well-known" or "none"

    def token(self, tokenizer: Any) -> str | None:
        return None if self.token_id is None else tokenizer.convert_ids_to_tokens(self.token_id)


def assistant_message(content: str, reasoning: str | None) -> dict:
    """A reply of the target as an assistant message for the chat template: what the generator sends back
    as an earlier turn of a conversation, and what the extractor renders a reply as. Its reasoning goes
    under both names: vLLM 0.32 reads ``reasoning`` (and hands the template both), the built-in server and
    SGLang pass ``reasoning_content`` through, the name thinking templates read. The template decides
    whether earlier reasoning is shown (most drop it)."""
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning"] = reasoning
        message["reasoning_content"] = reasoning
    return message


def special_ids(tokenizer: Any) -> set[int]:
    """Ids of every special token: the named ones and every added token marked special."""
    ids = {int(i) for i in tokenizer.all_special_ids}
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(int(i) for i, added in decoder.items() if getattr(added, "special", False))
    return ids


def eos_candidates(tokenizer: Any, configured: int | Iterable[int] | None = None) -> list[int]:
    """The target's eos ids: generation_config's (an int or a list) first, then the tokenizer's."""
    ids: list[int] = []
    if isinstance(configured, int):
        ids.append(configured)
    elif configured is not None:
        ids.extend(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return list(dict.fromkeys(ids))


def well_known_ids(tokenizer: Any) -> list[int]:
    vocab = tokenizer.get_vocab()
    return [vocab[t] for t in WELL_KNOWN_TURN_ENDS if t in vocab]


def template_turn_close(tokenizer: Any) -> list[int] | None:
    """Token ids the template writes after an assistant reply, or None when the probe cannot tell."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
    except Exception as exc:  # noqa: BLE001 - a template is user code; the fallbacks still answer
        log.info("chat template refuses the end-of-turn probe (%s: %s); using eos candidates", type(exc).__name__, exc)
        return None
    at = text.rfind(_PROBE_REPLY)
    if at < 0:
        return None
    return list(tokenizer(text[at + len(_PROBE_REPLY):], add_special_tokens=False)["input_ids"])


def find_turn_end(tokenizer: Any, eos_ids: int | Iterable[int] | None = None) -> TurnEnd:
    """The end-of-turn token of ``tokenizer``'s template (see the module docstring for the order)."""
    close = template_turn_close(tokenizer)
    specials = special_ids(tokenizer)
    if close:
        first = next((i for i in close if i in specials), None)
        if first is not None:
            return TurnEnd(int(first), "template")
    eos = eos_candidates(tokenizer, eos_ids)
    known = well_known_ids(tokenizer)
    both = [i for i in known if i in eos]
    if both:
        return TurnEnd(both[0], "well-known")
    if eos:
        return TurnEnd(eos[0], "eos")
    if known:
        return TurnEnd(known[0], "well-known")
    return TurnEnd(None, "none")
