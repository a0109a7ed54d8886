"""Token ids and loss mask of one sample, built with the target's own chat template.

The prompt is rendered with ``add_generation_prompt=True`` (what the target saw when it replied) and the
whole conversation with the reply appended as an assistant message. The full ids must extend the
prompt ids; the drafter then learns every token from the end of the prompt through the reply's
end-of-turn token, and nothing the template appends after it.
"""

from __future__ import annotations

from jinja2 import TemplateError

from shared.errors import ChatTemplateError, PromptTooLong


def render_ids(tokenizer, messages: list[dict], *, add_generation_prompt: bool) -> list[int]:
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
    except (TemplateError, ValueError, TypeError) as exc:
        raise ChatTemplateError(
            f"the chat template cannot render this conversation: {type(exc).__name__}: {exc}"
        ) from None
    return list(ids)


def assistant_message(content: str, reasoning_content: str | None) -> dict:
    message = {"role": "assistant", "content": content}
    if reasoning_content:
        message["reasoning_content"] = reasoning_content
    return message


def reply_end(full_ids: list[int], start: int, eos_id: int | None) -> int:
    """Index just past the reply's last end-of-turn token, or the end when the template writes none."""
    if eos_id is not None:
        for i in range(len(full_ids) - 1, start - 1, -1):
            if full_ids[i] == eos_id:
                return i + 1
    return len(full_ids)


def build_sample(tokenizer, messages: list[dict], reply_content: str, reasoning_content: str | None,
                 max_length: int) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)``, truncated to ``max_length``; PromptTooLong when no reply token fits."""
    prefix = render_ids(tokenizer, messages, add_generation_prompt=True)
    if len(prefix) >= max_length:
        raise PromptTooLong(f"prompt is {len(prefix)} tokens; max_length {max_length} leaves no room for the reply")
    full = render_ids(tokenizer, [*messages, assistant_message(reply_content, reasoning_content)],
                      add_generation_prompt=False)
    if full[: len(prefix)] != prefix:
        at = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
        raise ChatTemplateError(
            f"the conversation's tokens do not start with the prompt's "
            f"(first difference at token {at} of {len(prefix)}); "
            "the chat template renders the prompt differently once the reply is appended"
        )
    end = reply_end(full, len(prefix), tokenizer.eos_token_id)
    mask = [0] * len(prefix) + [1] * (end - len(prefix)) + [0] * (len(full) - end)
    return full[:max_length], mask[:max_length]
