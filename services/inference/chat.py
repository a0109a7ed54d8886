"""Chat requests in and out: render the prompt, budget the reply, build the OpenAI response."""

from __future__ import annotations

import time
import uuid
from typing import Any

from services.inference.decode import GenerationResult
from services.inference.model import LoadedModel
from services.inference.reasoning import split_reasoning
from shared.errors import ChatTemplateError, PromptTooLong

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when a request names none
DEFAULT_TOP_P = 1.0


def render_prompt(loaded: LoadedModel, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None) -> list[int]:
    """Token ids of the conversation plus the assistant's generation prompt, through the target's template."""
    tokenizer = loaded.tokenizer
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **(template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - a template is user code: whatever it raises is the request's fault
        raise ChatTemplateError(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") from None
    # The template writes the special tokens (BOS included) itself.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def reply_budget(prompt_tokens: int, requested: int | None, context_length: int) -> int:
    """Most tokens the reply may have: what was asked for, capped by the room left in the context."""
    room = context_length - prompt_tokens
    if room < 1:
        raise PromptTooLong(
            f"the prompt has {prompt_tokens} tokens and the model's context is {context_length} tokens, "
            "which leaves no room for a reply"
        )
    return room if requested is None else min(requested, room)


def completion_response(
    loaded: LoadedModel,
    prompt_ids: list[int],
    result: GenerationResult,
    *,
    with_token_ids: bool,
) -> dict[str, Any]:
    text = loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    reasoning, content = split_reasoning(text, enabled=loaded.knows_think_close)
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": content, "reasoning_content": reasoning},
        "finish_reason": result.finish_reason,
        "logprobs": None,
    }
    response: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": loaded.name,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(result.token_ids),
            "total_tokens": len(prompt_ids) + len(result.token_ids),
        },
    }
    if with_token_ids:
        choice["token_ids"] = list(result.token_ids)
        response["prompt_token_ids"] = list(prompt_ids)
    return response
