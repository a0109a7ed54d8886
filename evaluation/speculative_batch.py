"""Greedy chain speculative decoding of many prompts at once: one target pass verifies every row's block.

A small target's pass costs about the same for one row as for a hundred (kernel launches and Python, not
arithmetic, bound it), so decoding a set's prompts together makes evaluation as fast as its longest reply
instead of the sum of its replies. Each row follows exactly the single-sequence loop of ``speculative``:
same accept rule, same positions, same drafter inputs; only the bookkeeping differs.

Rows keep their own lengths inside one padded KV cache. Prompts are left-padded; every pass appends the
same number of columns to every row (1 + the longest proposal), and a column a row does not keep (its
rejected drafts, its padding) stays in the cache masked out (attention mask 0) instead of being cut, so
no row waits for another. Positions are explicit per row, so a masked column never shifts a later
token's position. A finished row leaves the batch: its cache rows are dropped.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from modeling.dflash import DFlashDrafter
from evaluation.lookup import LookupProposer, NoProposer
from modeling.eagle3 import Eagle3Drafter, MaskedKVCache
from evaluation.speculative import DecodeResult, accepted_prefix, cache_kwarg, eos_ids_of, finished
from modeling.padding import left_pad


@dataclass
class Verified:
    """What one target pass settled for the active rows, in cache columns (A rows, W columns)."""

    aux: torch.Tensor  # (A, W, 3Ht) the target's aux states at those columns
    next_ids: torch.Tensor  # (A, W) the token that follows each column's position (padding where unused)
    used: torch.Tensor  # (A, W) bool: the column holds a position of its row
    positions: torch.Tensor  # (A, W) each column's position in its row's sequence
    tokens: list[list[int]]  # per row, the used columns' next tokens, in order


class BatchProposer(Protocol):
    def extend(self, verified: Verified) -> None:
        """Take the newly verified positions of every active row."""

    def propose(self, k: int) -> list[list[int]]:
        """Per active row, at most ``k`` next tokens (target ids); fewer, or none, is allowed."""

    def select(self, rows: list[int]) -> None:
        """Keep only these active rows (the others finished)."""


def newest_columns(used: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``used`` (A, W) -> (row index (A,), each row's last used column (A,)): where a row's newest verified
    position is among a pass's columns."""
    columns = torch.arange(used.shape[1], device=used.device)
    return torch.arange(used.shape[0], device=used.device), torch.where(used, columns, -1).max(-1).values


class BatchDrafterProposer:
    """The EAGLE-3 drafter over every row: a masked cache over verified positions, a chain per proposal."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        self.drafter = drafter
        self.device = drafter.fc.weight.device
        self.cache = MaskedKVCache()
        self.last: torch.Tensor | None = None  # (A, 1, H) output at each row's newest verified position
        self.newest: torch.Tensor | None = None  # (A,) that position

    def extend(self, verified: Verified) -> None:
        d = self.drafter
        used = verified.used.to(self.device)
        aux = verified.aux.to(self.device, d.fc.weight.dtype) * used[..., None]  # unused columns carry zeros
        self.cache.incoming = used
        out = d(d.fuse(aux), verified.next_ids.to(self.device), verified.positions.to(self.device), self.cache)
        rows, newest = newest_columns(used)
        self.last = out[rows, newest][:, None]  # (A, 1, H)
        self.newest = verified.positions.to(self.device)[rows, newest]

    def propose(self, k: int) -> list[list[int]]:
        d, hidden, drafts, length = self.drafter, self.last, [], self.cache.length
        for j in range(k):
            if j > 0:  # chain step j: own previous output + the token it just proposed, one position on
                hidden = d(hidden, drafts[-1][:, None], (self.newest + j)[:, None], self.cache)  # (A, 1, H)
            drafts.append(d.to_target_ids(d.logits(hidden)[:, -1].argmax(-1)))  # (A,)
        self.cache.crop(length)  # chain columns are recomputed from the target's states next time
        return torch.stack(drafts, dim=1).tolist() if drafts else [[] for _ in range(hidden.shape[0])]

    def select(self, rows: list[int]) -> None:
        index = torch.tensor(rows, device=self.device)
        self.cache.select(index)
        self.last, self.newest = self.last[index], self.newest[index]


class BatchBlockProposer:
    """The DFlash drafter over every row: each layer's context keys and values over the verified columns (a
    rejected or padding column stays, masked), and one block pass per proposal: the row's newest token at the
    position after its newest verified one, then ``k`` mask slots, each slot's argmax a draft."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter
        self.device = drafter.fc.weight.device
        self.context: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (A, nkv, C, hd) keys, values
        self.used: torch.Tensor | None = None  # (A, C) bool: the column holds a verified position of its row
        self.bonus: torch.Tensor | None = None  # (A,) the newest token, not yet verified
        self.start: torch.Tensor | None = None  # (A,) its position

    def extend(self, verified: Verified) -> None:
        d = self.drafter
        used = verified.used.to(self.device)
        aux = verified.aux.to(self.device, d.fc.weight.dtype) * used[..., None]
        positions = verified.positions.to(self.device)
        new = d.context(aux, positions)
        self.context = new if not self.context else [
            (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2)) for (k, v), (nk, nv) in zip(self.context, new)]
        self.used = used if self.used is None else torch.cat([self.used, used], dim=1)
        rows, newest = newest_columns(used)
        self.bonus = verified.next_ids.to(self.device)[rows, newest]
        self.start = positions[rows, newest] + 1

    def propose(self, k: int) -> list[list[int]]:
        d = self.drafter
        if k == 0:
            return [[] for _ in range(self.bonus.shape[0])]
        hidden = d.draft(self.bonus[:, None], self.start[:, None], k + 1, self.context, self.used[:, None])  # (A, 1, k+1, H)
        return d.to_target_ids(d.logits(hidden[:, 0, 1:]).argmax(-1)).tolist()  # the mask slots' tokens, (A, k)

    def select(self, rows: list[int]) -> None:
        index = torch.tensor(rows, device=self.device)
        self.context = [(k[index], v[index]) for k, v in self.context]
        self.used, self.bonus, self.start = self.used[index], self.bonus[index], self.start[index]


def drafter_proposer(drafter: Eagle3Drafter | DFlashDrafter) -> BatchDrafterProposer | BatchBlockProposer:
    """The proposer that drafts as the engines serve this drafter: EAGLE-3's chain or DFlash's block."""
    return BatchBlockProposer(drafter) if isinstance(drafter, DFlashDrafter) else BatchDrafterProposer(drafter)


class RowProposers:
    """Token-only proposers (prompt lookup, none), one per row: the target's states go unused."""

    def __init__(self, proposers: Sequence[LookupProposer | NoProposer]) -> None:
        self.rows = list(proposers)

    def extend(self, verified: Verified) -> None:
        for proposer, tokens in zip(self.rows, verified.tokens):
            proposer.extend(None, tokens)

    def propose(self, k: int) -> list[list[int]]:
        return [proposer.propose(k) for proposer in self.rows]

    def select(self, rows: list[int]) -> None:
        self.rows = [self.rows[i] for i in rows]


def pad_id_of(target: Any) -> int:
    pad = target.generation_config.pad_token_id
    return int(pad) if pad is not None else min(eos_ids_of(target) or {0})


@dataclass
class BatchPrefill:
    """The target's pass over every prompt, shared by every decode of the set (each decodes a copy)."""

    cache: Any  # transformers DynamicCache, (B, P) columns
    mask: torch.Tensor  # (B, P) long, 1 where a prompt token is
    first: list[int]  # the target's greedy token after each prompt
    verified: Verified  # the prompt columns, as every proposer's first ``extend`` takes them


@torch.inference_mode()
def prefill_batch(target: Any, prompts: Sequence[Sequence[int]], layer_ids: list[int]) -> BatchPrefill:
    from transformers import DynamicCache

    ids, mask = left_pad(prompts, pad_id_of(target), target.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P), padding gets 0 and is masked anyway
    cache = DynamicCache()
    out = target(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                 output_hidden_states=True, **{cache_kwarg(target): cache})  # logits of the last column only
    first = out.logits[:, -1].argmax(-1)  # (B,)
    next_ids = torch.cat([ids[:, 1:], first[:, None]], dim=1)  # position p pairs with x_{p+1}
    tokens = [[*prompt[1:], f] for prompt, f in zip(prompts, first.tolist())]
    aux = aux_of(out.hidden_states, layer_ids)  # (B, P, 3Ht)
    return BatchPrefill(cache, mask, first.tolist(), Verified(aux, next_ids, mask.bool(), positions, tokens))


@torch.inference_mode()
def speculative_generate_batch(
    target: Any, proposer: BatchProposer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, draft_steps: int,
    layer_ids: list[int], prefill: BatchPrefill | None = None,
) -> list[DecodeResult]:
    """Every prompt decoded as ``speculative.speculative_generate`` decodes it alone; one result per prompt."""
    pre = prefill if prefill is not None else prefill_batch(target, prompts, layer_ids)
    device, eos, pad = target.device, eos_ids_of(target), pad_id_of(target)
    cache, mask = copy.deepcopy(pre.cache), pre.mask
    forward_kw = {cache_kwarg(target): cache, "use_cache": True, "output_hidden_states": True}
    results = [DecodeResult(tokens=[first]) for first in pre.first]
    active = list(range(len(prompts)))  # result index of each row still decoding
    lengths = torch.tensor([len(p) for p in prompts], device=device)  # (A,) verified positions per row
    proposer.extend(pre.verified)
    active, lengths, mask = _drop_finished(results, active, lengths, mask, cache, proposer, max_new_tokens, eos)
    while active:
        drafts = proposer.propose(draft_steps)
        for row in drafts:
            if len(row) > draft_steps:
                raise ValueError(f"{type(proposer).__name__} proposed {len(row)} tokens, more than the {draft_steps} asked")
        width = 1 + max(len(row) for row in drafts)
        block = torch.tensor([[results[i].tokens[-1], *row, *[pad] * (width - 1 - len(row))]
                              for i, row in zip(active, drafts)], device=device)  # (A, W)
        positions = lengths[:, None] + torch.arange(width, device=device)  # (A, W)
        mask = torch.cat([mask, mask.new_ones(block.shape)], dim=1)  # the block sees itself; fixed up below
        out = target(input_ids=block, attention_mask=mask, position_ids=positions, **forward_kw)
        greedy = out.logits.argmax(-1).tolist()  # (A, W): greedy[r][j], the target's choice after block token j
        used, next_ids, tokens = [], [], []
        for r, (index, row) in enumerate(zip(active, drafts)):
            accepted = accepted_prefix(row, greedy[r])
            new = [*row[:accepted], greedy[r][accepted]]
            emitted = 0
            while emitted < len(new) and not finished(results[index].tokens, max_new_tokens, eos):
                results[index].tokens.append(new[emitted])
                emitted += 1
            results[index].accepted.append(emitted)
            results[index].matched.append(accepted)
            used.append([j <= accepted for j in range(width)])
            next_ids.append([*new, *[pad] * (width - len(new))])
            tokens.append(new)
        used_t = torch.tensor(used, device=device)  # (A, W)
        mask[:, -width:] = used_t.long()  # rejected drafts stay in the cache, masked from now on
        lengths = lengths + used_t.sum(-1)
        proposer.extend(Verified(aux_of(out.hidden_states, layer_ids), torch.tensor(next_ids, device=device), used_t,
                                 positions, tokens))
        active, lengths, mask = _drop_finished(results, active, lengths, mask, cache, proposer, max_new_tokens, eos)
    return results


def _drop_finished(results: list[DecodeResult], active: list[int], lengths: torch.Tensor, mask: torch.Tensor,
                   cache: Any, proposer: BatchProposer, max_new_tokens: int,
                   eos: set[int]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    keep = [r for r, index in enumerate(active) if not finished(results[index].tokens, max_new_tokens, eos)]
    if len(keep) == len(active) or not keep:
        return [active[r] for r in keep], lengths, mask
    index = torch.tensor(keep, device=mask.device)
    cache.batch_select_indices(index)
    proposer.select(keep)
    return [active[r] for r in keep], lengths[index], mask[index]


def aux_of(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """(B, T, 3H) from HF ``output_hidden_states``: ``speculative.aux_states`` for every row."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)
