"""Decode a batch of chat requests together with one KV cache.

Prompts are left-padded so every row's next token sits in the last column; the attention mask hides the
padding and explicit position ids start each row at 0, so a row computes what it would compute alone.
A row leaves the batch (and the cache) as soon as it emits an end-of-sequence token or reaches its
``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from services.inference.model import LoadedModel
from services.inference.sampling import SamplingParams, make_generator, next_tokens
from modeling.padding import left_pad


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class GenerationResult:
    token_ids: list[int]  # the reply, including the end-of-sequence token when it stopped on one
    finish_reason: str = "length"  # "stop" or "length"


def new_cache(model: PreTrainedModel) -> tuple[str, DynamicCache]:
    """An empty KV cache and the forward keyword that takes it (``cache`` in recent transformers,
    ``past_key_values`` before); holding our own reference spares reading it back from each output."""
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:
        cache = DynamicCache()
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return keyword, cache


class BatchDecoder:
    """One decode run over a fixed set of requests."""

    def __init__(self, loaded: LoadedModel, requests: Sequence[GenerationRequest]) -> None:
        if not requests or any(not r.prompt_ids or r.max_new_tokens < 1 for r in requests):
            raise ValueError("every request needs a non-empty prompt and max_new_tokens >= 1")
        self.loaded = loaded
        self.requests = list(requests)
        self.results = [GenerationResult([]) for _ in requests]
        self.generators = [make_generator(r.sampling, loaded.device) for r in requests]
        self.active = list(range(len(requests)))  # request index of each row still decoding

    def run(self) -> list[GenerationResult]:
        with torch.inference_mode():
            ids, mask = left_pad([r.prompt_ids for r in self.requests], self.loaded.pad_token_id, self.loaded.device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T), pads get 0 and are masked anyway
            keyword, cache = new_cache(self.loaded.model)
            out = self.loaded.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                    use_cache=True, logits_to_keep=1, **{keyword: cache})
            next_pos = mask.sum(-1)  # (B,) position of each row's next token
            while True:
                tokens = self._choose(out.logits[:, -1, :])  # (B,)
                keep = self._record(tokens.tolist())
                if not keep:
                    return self.results
                if len(keep) < len(self.active):
                    index = torch.tensor(keep, device=self.loaded.device)
                    cache.batch_select_indices(index)
                    mask, next_pos, tokens = mask[index], next_pos[index], tokens[index]
                    self.active = [self.active[row] for row in keep]
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)  # (B, T + 1)
                out = self.loaded.model(input_ids=tokens[:, None], attention_mask=mask,
                                        position_ids=next_pos[:, None], use_cache=True, **{keyword: cache})
                next_pos = next_pos + 1

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        params = [self.requests[i].sampling for i in self.active]
        generators = [self.generators[i] for i in self.active]
        return next_tokens(logits.float(), params, generators)

    def _record(self, tokens: list[int]) -> list[int]:
        """Append each row's token; return the rows that go on decoding."""
        keep = []
        for row, (index, token) in enumerate(zip(self.active, tokens)):
            result = self.results[index]
            result.token_ids.append(token)
            if token in self.loaded.eos_token_ids:
                result.finish_reason = "stop"
            elif len(result.token_ids) < self.requests[index].max_new_tokens:
                keep.append(row)
        return keep


def generate_batch(loaded: LoadedModel, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """Decode ``requests`` together; each result is what the request would produce alone."""
    return BatchDecoder(loaded, requests).run()
