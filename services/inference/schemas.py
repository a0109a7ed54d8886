"""Request bodies. Validation failures become 400 answers that name the field (see routes.errors)."""

from __future__ import annotations

from pathlib import PurePath
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from shared.runspec import HiddenStorage

SAFETENSORS_SUFFIX = ".safetensors"
MAX_SEED = 2**63 - 1
MAX_METADATA_BYTES = 64 << 10  # the safetensors header holds the metadata; a large one is refused, not written
# tokenizer.apply_chat_template's own parameters: a client passing these (its own `chat_template` above all)
# would run its template or change what the call returns, so they are refused as template variables.
TEMPLATE_PARAMETERS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def check_utf8(value: Any, where: str) -> None:
    """Refuse text that UTF-8 cannot encode (a lone surrogate), in ``value`` or anything it holds."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where} holds text that is not valid Unicode (a lone surrogate)") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_utf8(key, where)
            check_utf8(item, where)
    elif isinstance(value, list):
        for item in value:
            check_utf8(item, where)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One OpenAI message; extra keys (``reasoning_content``, ``name``) pass through to the chat template."""

    model_config = ConfigDict(extra="allow")
    role: str = Field(..., min_length=1)
    content: str | list[ContentPart] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: str | list[ContentPart] | None) -> str | list[ContentPart] | None:
        for part in content if isinstance(content, list) else []:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported; send text")
        return content

    @model_validator(mode="after")
    def _encodable(self) -> ChatMessage:
        check_utf8(self.model_dump(), "a message")  # the tokenizer cannot take a lone surrogate
        return self

    def template_dict(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text or "" for part in self.content)
        return message


class ChatCompletionRequest(BaseModel):
    """The OpenAI chat-completions body; fields we do not use are ignored, as vLLM ignores them."""

    model_config = ConfigDict(extra="ignore")
    messages: list[ChatMessage] = Field(..., min_length=1)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_ids: bool = Field(False, description="vLLM's extension: add prompt_token_ids and token_ids.")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, stream: bool) -> bool:
        if stream:
            raise ValueError("streaming is not supported; send stream=false")
        return stream

    @field_validator("stop")
    @classmethod
    def _no_stop(cls, stop: str | list[str] | None) -> None:
        if stop:
            raise ValueError("stop sequences are not supported; the reply ends at the model's end-of-sequence token")
        return None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: bool | None) -> bool | None:
        if logprobs:
            raise ValueError("logprobs are not supported")
        return logprobs

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        refused = sorted(TEMPLATE_PARAMETERS.intersection(kwargs or {}))
        if refused:
            raise ValueError(f"chat_template_kwargs may not set {refused}: they are the template call's own parameters")
        return kwargs

    @property
    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class HiddenStatesRequest(BaseModel):
    """One sample to run through the target; the states go to ``path`` on the data volume."""

    model_config = ConfigDict(extra="forbid")
    # Strict: 1.0, "1" and true are not token ids; a client that sends them has a bug worth hearing about.
    input_ids: list[Annotated[StrictInt, Field(ge=0)]] = Field(..., min_length=1)
    loss_mask: list[Annotated[StrictInt, Field(ge=0, le=1)]]
    path: str = Field(..., min_length=1, description="Relative to the data volume, or absolute inside it.")
    layer_ids: list[StrictInt] | None = Field(None, min_length=3, max_length=3)
    metadata: dict[str, str] = Field(default_factory=dict)
    storage: HiddenStorage = Field("target", description="The target's dtype, or fp8 with scales (shared.eagle3).")

    @field_validator("path")
    @classmethod
    def _safetensors_path(cls, path: str) -> str:
        if not path.endswith(SAFETENSORS_SUFFIX) or PurePath(path).name == SAFETENSORS_SUFFIX:
            raise ValueError(f"path must name a {SAFETENSORS_SUFFIX} file")
        return path

    @field_validator("metadata")
    @classmethod
    def _small_text_metadata(cls, metadata: dict[str, str]) -> dict[str, str]:
        check_utf8(metadata, "metadata")
        size = sum(len(key.encode()) + len(value.encode()) for key, value in metadata.items())
        if size > MAX_METADATA_BYTES:
            raise ValueError(f"metadata holds {size} bytes of keys and values; at most {MAX_METADATA_BYTES} fit")
        return metadata

    @model_validator(mode="after")
    def _mask_matches_tokens(self) -> HiddenStatesRequest:
        if len(self.loss_mask) != len(self.input_ids):
            raise ValueError(f"loss_mask has {len(self.loss_mask)} values for {len(self.input_ids)} input_ids")
        return self
