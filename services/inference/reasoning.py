"""Split a reply into reasoning and answer, the way reasoning parsers of vLLM and SGLang report it."""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_reasoning(text: str, *, enabled: bool) -> tuple[str | None, str]:
    """``(reasoning_content, content)``.

    Text before ``</think>`` (minus a leading ``<think>``) is the reasoning and the rest the answer.
    Nothing is stripped, so ``<think>`` + reasoning + ``</think>`` + content renders back exactly what the
    target wrote. A reply cut off while still thinking (``<think>`` and no close) is all reasoning; a
    reply without any marker, or a tokenizer that has no ``</think>`` (``enabled`` false), is all answer.
    """
    if not enabled:
        return None, text
    head, close, tail = text.partition(THINK_CLOSE)
    if close:
        return head.removeprefix(THINK_OPEN), tail
    if text.startswith(THINK_OPEN):
        return text[len(THINK_OPEN):], ""
    return None, text
