"""A small, real OpenAI-compatible HTTP server whose answers each test scripts.

It stands in for vLLM or SGLang where a test needs a particular answer: reasoning in
``reasoning_content`` or ``reasoning``, a 4xx with an OpenAI error body, a 5xx, a short reply. Answers
are keyed by the last user message's text; each key holds a list of answers used in order (the last one
repeats), so "503 once, then a reply" is ``[Reply(status=503), Reply("ok")]``. Every request body is
kept in ``requests`` for assertions. ``GET /health`` answers ``health_status`` and counts itself in
``health_checks``. uvicorn runs it in a thread on a free loopback port, chosen when the object is made,
so a test can point a client at a server that is not up yet.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.support.thread_server import ThreadServer


@dataclass(frozen=True)
class Reply:
    content: str | None = "a scripted reply from the stand-in target"
    reasoning: str | None = None
    reasoning_field: str = "reasoning_content"  # vLLM and SGLang; some builds say "reasoning"
    completion_tokens: int | None = None  # default: the number of words in reasoning + content
    finish_reason: str = "stop"
    status: int = 200
    error: str = "scripted error"
    include_usage: bool = True
    malformed: bool = False  # answer 200 with a body that is not a chat completion
    delay_s: float = 0.0  # seconds the answer takes, for a slow target

    def tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(f"{self.reasoning or ''} {self.content or ''}".split())


class OpenAIServer(ThreadServer):
    name = "openai-stand-in"

    def __init__(self, model: str = "stand-in-target") -> None:
        self.model = model
        super().__init__()
        self.requests: list[dict] = []
        self._script: dict[str, list[Reply]] = {}
        self._default = Reply()
        self.health_status = 200
        self.health_checks = 0
        self._lock = threading.Lock()

    def script(self, prompt: str, *replies: Reply) -> None:
        with self._lock:
            self._script[prompt] = list(replies)

    def set_default(self, reply: Reply) -> None:
        self._default = reply

    def requests_for(self, prompt: str) -> list[dict]:
        with self._lock:
            return [r for r in self.requests if _last_user(r) == prompt]

    def _next(self, body: dict) -> Reply:
        with self._lock:
            self.requests.append(body)
            replies = self._script.get(_last_user(body))
            if not replies:
                return self._default
            return replies.pop(0) if len(replies) > 1 else replies[0]

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        def health() -> JSONResponse:
            with self._lock:
                self.health_checks += 1
            return JSONResponse(status_code=self.health_status, content={"status": "scripted"})

        @app.get("/v1/models")
        def models() -> dict:
            return {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "tests"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            body = await request.json()
            reply = self._next(body)
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
            if reply.malformed:
                return JSONResponse(content={"object": "not-a-completion"})
            if reply.status != 200:
                error = {"error": {"message": reply.error, "type": "BadRequestError", "code": reply.status}}
                return JSONResponse(status_code=reply.status, content=error)
            return JSONResponse(content=self._completion(body, reply))

        return app

    def _completion(self, body: dict, reply: Reply) -> dict:
        message = {"role": "assistant", "content": reply.content}
        if reply.reasoning is not None:
            message[reply.reasoning_field] = reply.reasoning
        answer = {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason}],
        }
        if reply.include_usage:
            answer["usage"] = {"prompt_tokens": 10, "completion_tokens": reply.tokens(), "total_tokens": 10 + reply.tokens()}
        return answer



def _last_user(body: dict) -> str | None:
    for message in reversed(body.get("messages") or []):
        if message.get("role") == "user":
            return message.get("content")
    return None
