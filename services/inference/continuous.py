"""Continuous batching: requests join the decode as slots free up, instead of waiting for a whole batch.

One thread owns the ``SlotModel``. Each turn of its loop it admits waiting requests into free slots (their
prompts prefilled together, up to a token budget), then runs one decode step over every occupied slot, and
resolves each request that stopped (end of sequence or its ``max_new_tokens``) at once. A short reply no
longer waits for the longest reply of its batch, and the batch stays full while work is queued.

Slots come in pools of their own length: many short slots and a few long ones (``long``), each pool stepped
in the same loop, so a long prompt takes a long slot instead of holding up every other request. A request
that fits no pool is decoded alone by the per-batch decoder between steps, and says so in the log: it is
slower (and the others wait meanwhile), never refused or cut.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from services.inference.decode import GenerationRequest, GenerationResult, generate_batch
from services.inference.sampling import make_generator, next_tokens
from services.inference.scheduler import STOP, RequestQueue
from services.inference.slots import SlotModel

log = logging.getLogger(__name__)



@dataclass
class Occupant:
    """A request in a slot: what it has produced and the position its next token takes."""

    request: GenerationRequest
    future: Future
    generator: torch.Generator | None
    result: GenerationResult = field(default_factory=lambda: GenerationResult([]))

    @property
    def next_position(self) -> int:
        # The last emitted token is fed at the position after the prompt and the tokens before it.
        return len(self.request.prompt_ids) + len(self.result.token_ids) - 1


@dataclass
class Pool:
    """Slots of one length and who holds them."""

    model: SlotModel
    occupants: list[Occupant | None]

    @classmethod
    def of(cls, model: SlotModel) -> Pool:
        return cls(model, [None] * model.slots)

    def fits(self, request: GenerationRequest) -> bool:
        # The last token is never fed back, so a slot needs prompt + budget - 1 positions.
        return len(request.prompt_ids) + request.max_new_tokens - 1 <= self.model.slot_tokens

    @property
    def busy(self) -> bool:
        return any(o is not None for o in self.occupants)


class ContinuousScheduler(RequestQueue):
    def __init__(
        self,
        slots: SlotModel,
        *,
        prefill_tokens: int,
        long: SlotModel | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        self._pools = [Pool.of(slots)] + ([Pool.of(long)] if long is not None else [])
        self._pools.sort(key=lambda pool: pool.model.slot_tokens)  # a request takes the shortest slot it fits
        self._loaded = slots.loaded
        self._prefill_tokens = prefill_tokens
        self._on_step = on_step
        self._waiting: list[tuple[GenerationRequest, Future]] = []  # taken from the queue, not yet admitted
        self._stopping = False
        super().__init__("continuous-decoder")

    # -- the loop --------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            busy = any(pool.busy for pool in self._pools)
            self._take(block=not busy and not self._waiting)
            self._admit()
            stepped = False
            for pool in self._pools:
                if pool.busy:
                    self._step(pool)
                    stepped = True
            if not stepped and self._stopping and not self._waiting:
                return

    def _take(self, *, block: bool) -> None:
        """Move queued requests to the waiting list; block for one when there is nothing else to do."""
        while not self._stopping:
            try:
                item = self._queue.get(block=block)
            except queue.Empty:
                return
            block = False
            if item is STOP:
                self._stopping = True
                continue
            request, future = item
            if future.set_running_or_notify_cancel():  # a client that went away cancelled it
                self._waiting.append((request, future))

    def _admit(self) -> None:
        """Prefill waiting requests into free slots of the shortest pool each fits, up to the token budget
        per pool (one request at least), in order of arrival; a request whose pool is full waits without
        holding up those behind it. While a pool decodes, it admits once a sixteenth of its slots are free
        (or all it could take are waiting): a prefill costs about a decode step however few prompts it
        holds, so one prompt per freed slot would spend as much time prefilling as decoding (measured: 533
        prefills beside 1,397 steps, half the run)."""
        chosen: dict[int, list[tuple[int, GenerationRequest, Future]]] = {}
        free = {index: [slot for slot, o in enumerate(pool.occupants) if o is None]
                for index, pool in enumerate(self._pools)}
        width = dict.fromkeys(free, 0)
        wanted = dict.fromkeys(free, 0)
        keep: list[tuple[GenerationRequest, Future]] = []
        for request, future in self._waiting:
            index = next((i for i, pool in enumerate(self._pools) if pool.fits(request)), None)
            if index is None:
                self._decode_alone(request, future)
                continue
            wanted[index] += 1
            picked = chosen.setdefault(index, [])
            wider = max(width[index], len(request.prompt_ids))
            if len(picked) >= len(free[index]) or (picked and wider * (len(picked) + 1) > self._prefill_tokens):
                keep.append((request, future))
                continue
            width[index] = wider
            picked.append((free[index][len(picked)], request, future))
        for index, picked in list(chosen.items()):
            pool = self._pools[index]
            if pool.busy and len(free[index]) < min(wanted[index], max(1, len(pool.occupants) // 16)):
                keep.extend((request, future) for _, request, future in picked)  # not yet: see above
                del chosen[index]
        order = {id(future): n for n, (_, future) in enumerate(self._waiting)}
        self._waiting = sorted(keep, key=lambda item: order[id(item[1])])
        for index, picked in chosen.items():
            if picked:
                self._prefill(self._pools[index], picked)

    def _prefill(self, pool: Pool, picked: list[tuple[int, GenerationRequest, Future]]) -> None:
        occupants = [Occupant(request, future, make_generator(request.sampling, self._loaded.device))
                     for _, request, future in picked]
        try:
            logits = pool.model.prefill([r.prompt_ids for _, r, _ in picked], [slot for slot, _, _ in picked])
            tokens = self._choose(logits, occupants)
        except Exception as exc:
            log.exception("prefilling %d requests failed", len(picked))
            for occupant in occupants:
                occupant.future.set_exception(exc)
            return
        for (slot, _, _), occupant, token in zip(picked, occupants, tokens):
            pool.occupants[slot] = occupant
            self._record(pool, slot, token)

    def _step(self, pool: Pool) -> None:
        n = max(slot for slot, occupant in enumerate(pool.occupants) if occupant is not None) + 1
        rows = pool.occupants[:n]
        ids = [o.result.token_ids[-1] if o else self._loaded.pad_token_id for o in rows]
        positions = [o.next_position if o else 0 for o in rows]
        live = [slot for slot, o in enumerate(rows) if o is not None]
        if self._on_step is not None:
            self._on_step(len(live))
        try:
            logits = pool.model.decode(ids, positions)
            if len(live) < n:
                logits = logits[torch.tensor(live, device=logits.device)]
            tokens = self._choose(logits, [rows[slot] for slot in live])
        except Exception as exc:
            log.exception("a decode step of %d requests failed", len(live))
            for slot in live:
                pool.occupants[slot].future.set_exception(exc)
                pool.occupants[slot] = None
            return
        for slot, token in zip(live, tokens):
            self._record(pool, slot, token)

    def _choose(self, logits: torch.Tensor, occupants: list[Occupant]) -> list[int]:
        params = [o.request.sampling for o in occupants]
        if all(p.greedy for p in params):  # the argmax of the logits as they are: no float copy of (n, V)
            return logits.argmax(dim=-1).tolist()
        return next_tokens(logits.float(), params, [o.generator for o in occupants]).tolist()

    def _record(self, pool: Pool, slot: int, token: int) -> None:
        """Append the slot's token; a request that stopped leaves its slot with its result."""
        occupant = pool.occupants[slot]
        result = occupant.result
        result.token_ids.append(token)
        if token in self._loaded.eos_token_ids:
            result.finish_reason = "stop"
        elif len(result.token_ids) < occupant.request.max_new_tokens:
            return
        pool.occupants[slot] = None
        occupant.future.set_result(result)

    def _decode_alone(self, request: GenerationRequest, future: Future) -> None:
        log.warning("a request of %d prompt tokens and %d new tokens exceeds the longest slot (%d positions): "
                    "decoding it alone with the per-batch decoder", len(request.prompt_ids),
                    request.max_new_tokens, self._pools[-1].model.slot_tokens)
        try:
            future.set_result(generate_batch(self._loaded, [request])[0])
        except Exception as exc:
            future.set_exception(exc)
