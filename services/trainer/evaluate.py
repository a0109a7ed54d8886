"""Acceptance length: greedy chain speculative decoding of the drafter against the target.

The target is the real Hugging Face model with a KV cache. Per verification step the drafter proposes
``draft_steps`` tokens in a chain, the target checks them in one forward pass, and the output is the
target's own greedy decoding, token for token; only the number of target passes changes.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from shared.errors import DatasetError
from shared.runspec import EvalConfig
from services.trainer.model import Eagle3Drafter, KVCache

log = logging.getLogger(__name__)


class Proposer(Protocol):
    """What the decoding loop needs from a drafter."""

    def extend(self, aux: torch.Tensor, next_tokens: list[int]) -> None:
        """Take the target's aux states (m, 3Ht) at m newly verified positions and, for each, the token
        that follows it (the last one is the target's newest token, not yet fed to the target)."""

    def propose(self, k: int) -> list[int]:
        """The next ``k`` tokens (target ids) after the newest token."""


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

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def acceptance_length(self) -> float:
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0


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


@torch.inference_mode()
def speculative_generate(
    target: Any, proposer: Proposer, prompt_ids: list[int], *, max_new_tokens: int, draft_steps: int, layer_ids: list[int]
) -> DecodeResult:
    from transformers import DynamicCache

    device, eos = target.device, eos_ids_of(target)
    cache = DynamicCache()
    forward = functools.partial(target, use_cache=True, output_hidden_states=True, **{cache_kwarg(target): cache})
    out = forward(torch.tensor([prompt_ids], device=device))
    result = DecodeResult(tokens=[int(out.logits[0, -1].argmax())])
    proposer.extend(aux_states(out.hidden_states, layer_ids), prompt_ids[1:] + result.tokens)
    while not finished(result.tokens, max_new_tokens, eos):
        drafts = proposer.propose(draft_steps)
        context = cache.get_seq_length()
        out = forward(torch.tensor([[result.tokens[-1], *drafts]], device=device))  # positions context .. context+K
        greedy = out.logits[0].argmax(-1).tolist()  # greedy[i]: the target's choice after block token i
        accepted = accepted_prefix(drafts, greedy)
        new = [*drafts[:accepted], greedy[accepted]]
        emitted = 0
        while emitted < len(new) and not finished(result.tokens, max_new_tokens, eos):
            result.tokens.append(new[emitted])
            emitted += 1
        result.accepted.append(emitted)
        crop_cache(cache, context + accepted + 1)  # keep the newest token and the accepted drafts
        if not finished(result.tokens, max_new_tokens, eos):
            proposer.extend(aux_states(out.hidden_states, layer_ids)[: accepted + 1], new)
    return result


# ---- a run's evaluation --------------------------------------------------------------------------

@dataclass(frozen=True)
class EvalPrompt:
    sample_id: int
    messages: list[dict]


def read_eval_prompts(path: Path) -> list[EvalPrompt]:
    """``{"sample_id": int, "messages": [...]}`` per line; a malformed line is a DatasetError naming it."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no held-out prompts to evaluate on")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompts.append(EvalPrompt(int(row["sample_id"]), list(row["messages"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise DatasetError(f"{path}:{number}: malformed prompt row ({exc})") from None
    return prompts


def evaluate_prompts(
    target: Any, tokenizer: Any, drafter: Eagle3Drafter, prompts: list[EvalPrompt], cfg: EvalConfig,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Decode every prompt speculatively; acceptance length = emitted tokens / verification steps."""
    layer_ids = list(drafter.config.layer_ids)
    rows = []
    for done, prompt in enumerate(prompts, start=1):
        ids = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        decoded = speculative_generate(target, DrafterProposer(drafter), list(ids), max_new_tokens=cfg.max_new_tokens,
                                       draft_steps=cfg.draft_steps, layer_ids=layer_ids)
        rows.append({"sample_id": prompt.sample_id, "prompt_tokens": len(ids), "tokens": len(decoded.tokens),
                     "steps": decoded.steps, "accepted": decoded.accepted, "acceptance_length": decoded.acceptance_length})
        if progress is not None:
            progress(done, len(prompts))
    steps = sum(r["steps"] for r in rows)
    emitted = sum(sum(r["accepted"]) for r in rows)
    return {
        "acceptance_length": emitted / steps if steps else 0.0,
        "draft_steps": cfg.draft_steps,
        "max_new_tokens": cfg.max_new_tokens,
        "prompts": rows,
        "steps": steps,
        "tokens": sum(r["tokens"] for r in rows),
        "layer_ids": layer_ids,
    }


def load_target(model_dir: Path, device: torch.device) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    return target, AutoTokenizer.from_pretrained(model_dir)
