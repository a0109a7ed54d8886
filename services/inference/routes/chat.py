"""``POST /v1/chat/completions``: OpenAI-compatible, non-streaming, one choice."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter

from services.inference.chat import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, completion_response, render_prompt, reply_budget
from services.inference.decode import GenerationRequest
from services.inference.routes.deps import RuntimeDep
from services.inference.routes.errors import ApiError
from services.inference.runtime import CHAT_ENDPOINT
from services.inference.sampling import SamplingParams
from services.inference.schemas import ChatCompletionRequest

router = APIRouter()


@router.post(CHAT_ENDPOINT)
async def chat_completions(body: ChatCompletionRequest, runtime: RuntimeDep) -> dict[str, Any]:
    loaded = runtime.loaded
    if body.model is not None and body.model != loaded.name:
        raise ApiError(404, "NotFoundError", f"The model `{body.model}` does not exist.")
    prompt_ids = render_prompt(loaded, [m.template_dict() for m in body.messages], body.chat_template_kwargs)
    request = GenerationRequest(
        prompt_ids=prompt_ids,
        max_new_tokens=reply_budget(len(prompt_ids), body.requested_tokens, loaded.context_length),
        sampling=SamplingParams(
            temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            top_p=DEFAULT_TOP_P if body.top_p is None else body.top_p,
            seed=body.seed,
        ),
    )
    result = await asyncio.wrap_future(runtime.scheduler.submit(request))
    runtime.metrics.generated_tokens.inc(len(result.token_ids))
    return completion_response(loaded, prompt_ids, result, with_token_ids=body.return_token_ids)
