"""Greedy chain speculative decoding of one sequence: the reference loop, a proposer at a time.

The target is the real Hugging Face model with a KV cache. Per verification pass a proposer offers up
to k tokens in a chain, the target checks them in one forward pass, and the output is the target's own
greedy decoding, token for token; only the number of target passes changes. ``speculative_batch``
decodes many prompts at once with the same accept rule and proposers' arithmetic; this loop is the one
it is tested against, and the one the alignment tests read.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from modeling.eagle3 import Eagle3Drafter, KVCache


class Proposer(Protocol):
    """What the decoding loop needs from a drafter."""

    def extend(self, aux: torch.Tensor, next_tokens: list[int]) -> None:
        """Take the target's aux states (m, 3Ht) at m newly verified positions and, for each, the token
        that follows it (the last one is the target's newest token, not yet fed to the target)."""

    def propose(self, k: int) -> list[int]:
        """At most ``k`` next tokens (target ids) after the newest token; fewer, or none, is allowed."""


class DrafterProposer:
    """The EAGLE-3 drafter: a persistent cache over verified positions, a temporary chain per proposal."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        self.drafter = drafter
        self.device = drafter.fc.weight.device
        self.cache = KVCache()
        self.length = 0  # verified positions in the cache
        self.last: torch.Tensor | None = None  # (1, 1, H) output at the newest verified position

    def extend(self, aux: torch.Tensor, next_tokens: list[int]) -> None:
        d, m = self.drafter, aux.shape[0]
        hidden = d.fuse(aux[None].to(self.device, d.fc.weight.dtype))  # (1, m, H)
        tokens = torch.tensor([next_tokens], device=self.device)  # (1, m): position p pairs with x_{p+1}
        positions = torch.arange(self.length, self.length + m, device=self.device)[None]  # (1, m)
        self.last = d(hidden, tokens, positions, self.cache)[:, -1:]  # (1, 1, H)
        self.length += m

    def propose(self, k: int) -> list[int]:
        d, hidden, drafts = self.drafter, self.last, []
        for j in range(k):
            if j > 0:  # chain step j: own previous output + the token it just proposed, one position on
                token = torch.tensor([[drafts[-1]]], device=self.device)
                position = torch.tensor([[self.length - 1 + j]], device=self.device)
                hidden = d(hidden, token, position, self.cache)  # (1, 1, H)
            drafts.append(int(d.to_target_ids(d.logits(hidden)[0, -1].argmax())))
        self.cache.crop(self.length)  # chain entries are recomputed from the target's states next time
        return drafts


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens, the prefill's first token included
    accepted: list[int] = field(default_factory=list)  # tokens each verification step emitted
    # Drafts the target accepted at each step, also those past the reply's end (its budget or an eos) that the
    # step could not emit: what vLLM counts (vllm:spec_decode_num_accepted_tokens), so its acceptance length
    # is 1 + sum(matched) / steps, at or above ours by what the last step proposed past the end.
    matched: list[int] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def acceptance_length(self) -> float:
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0


@dataclass
class Tally:
    """Emitted tokens and verification passes, summed over decodes (one method at one k)."""

    emitted: int = 0
    passes: int = 0

    def add(self, decoded: DecodeResult) -> None:
        self.count(sum(decoded.accepted), decoded.steps)

    def count(self, emitted: int, passes: int) -> None:
        self.emitted += emitted
        self.passes += passes

    @property
    def acceptance_length(self) -> float:
        return self.emitted / self.passes if self.passes else 0.0


def aux_states(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """(T, 3H) from HF ``output_hidden_states`` (index 0 = embeddings, so layer i's output is i + 1)."""
    return torch.cat([hidden_states[i + 1][0] for i in layer_ids], dim=-1)


def crop_cache(cache: Any, keep: int) -> None:
    remove = cache.get_seq_length() - keep
    if remove > 0:  # a negative argument removes that many tokens in every transformers version
        cache.crop(-remove)


def cache_kwarg(target: Any) -> str:
    """transformers 5.2x renames ``past_key_values`` to ``cache``; older versions know only the former."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def eos_ids_of(target: Any) -> set[int]:
    eos = target.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def accepted_prefix(drafts: list[int], greedy: list[int]) -> int:
    """Accept rule: draft i (0-based) is accepted when drafts 0..i-1 were and it equals greedy[i], the
    target's own choice after the tokens before it. With a accepted, the step emits drafts[:a] plus
    greedy[a]: the correction where drafts[a] was wrong, or the bonus token after a fully accepted chain.
    Every emitted token is thus the target's greedy token, and one target pass yields a + 1 of them."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
        accepted += 1
    return accepted


def finished(tokens: list[int], max_new_tokens: int, eos: set[int]) -> bool:
    """Where greedy decoding (``generate``) stops: at the budget or right after an eos token."""
    return len(tokens) >= max_new_tokens or tokens[-1] in eos


@dataclass
class Prefill:
    """The target's pass over a prompt, shared by every decode of it: each decode crops the cache back to
    the prompt (exact: cropping only drops entries) instead of reading the prompt again."""

    cache: Any  # transformers DynamicCache
    first: int  # the target's greedy token after the prompt
    aux: torch.Tensor  # (P, 3Ht) aux states at the prompt's positions
    length: int


@torch.inference_mode()
def prefill_prompt(target: Any, prompt_ids: list[int], layer_ids: list[int]) -> Prefill:
    from transformers import DynamicCache

    cache = DynamicCache()
    out = target(torch.tensor([prompt_ids], device=target.device), use_cache=True, output_hidden_states=True,
                 **{cache_kwarg(target): cache})
    return Prefill(cache, int(out.logits[0, -1].argmax()), aux_states(out.hidden_states, layer_ids), len(prompt_ids))


@torch.inference_mode()
def speculative_generate(
    target: Any, proposer: Proposer, prompt_ids: list[int], *, max_new_tokens: int, draft_steps: int, layer_ids: list[int],
    prefill: Prefill | None = None,
) -> DecodeResult:
    """Greedy chain speculative decoding; the proposer may propose fewer than ``draft_steps`` tokens, or
    none (then the pass verifies only the newest token and emits exactly one)."""
    pre = prefill if prefill is not None else prefill_prompt(target, prompt_ids, layer_ids)
    crop_cache(pre.cache, pre.length)
    device, eos, cache = target.device, eos_ids_of(target), pre.cache
    forward = functools.partial(target, use_cache=True, output_hidden_states=True, **{cache_kwarg(target): cache})
    result = DecodeResult(tokens=[pre.first])
    proposer.extend(pre.aux, prompt_ids[1:] + result.tokens)
    while not finished(result.tokens, max_new_tokens, eos):
        drafts = proposer.propose(draft_steps)
        if len(drafts) > draft_steps:
            raise ValueError(f"{type(proposer).__name__} proposed {len(drafts)} tokens, more than the {draft_steps} asked")
        context = cache.get_seq_length()
        out = forward(torch.tensor([[result.tokens[-1], *drafts]], device=device))  # positions context .. context+len(drafts)
        greedy = out.logits[0].argmax(-1).tolist()  # greedy[i]: the target's choice after block token i
        accepted = accepted_prefix(drafts, greedy)
        new = [*drafts[:accepted], greedy[accepted]]
        emitted = 0
        while emitted < len(new) and not finished(result.tokens, max_new_tokens, eos):
            result.tokens.append(new[emitted])
            emitted += 1
        result.accepted.append(emitted)
        result.matched.append(accepted)
        crop_cache(cache, context + accepted + 1)  # keep the newest token and the accepted drafts
        if not finished(result.tokens, max_new_tokens, eos):
            proposer.extend(aux_states(out.hidden_states, layer_ids)[: accepted + 1], new)
    return result
