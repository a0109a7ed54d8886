"""Collect concurrent chat requests into batches and decode each batch on one thread.

The first waiting request opens a batch; the batch closes when ``max_batch_size`` requests joined or
``batch_wait_ms`` passed, then decodes to completion while later requests queue for the next batch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from services.inference.decode import GenerationRequest, GenerationResult

log = logging.getLogger(__name__)

DecodeFn = Callable[[Sequence[GenerationRequest]], list[GenerationResult]]
STOP = object()  # queued by stop(): the decoding thread finishes what came before it, then ends


class RequestQueue:
    """Chat requests queued for one decoding thread (``_loop``, a subclass's); each answered on its future."""

    def __init__(self, thread_name: str) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)

    def _loop(self) -> None:
        raise NotImplementedError

    def start(self):
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the work in progress and every queued request, then end the thread."""
        self._queue.put(STOP)
        self._thread.join(timeout)

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        """Refuses an empty prompt or budget at once, so it never fails the requests decoded beside it."""
        if not request.prompt_ids or request.max_new_tokens < 1:
            raise ValueError("every request needs a non-empty prompt and max_new_tokens >= 1")
        future: Future[GenerationResult] = Future()
        self._queue.put((request, future))
        return future


class ChatScheduler(RequestQueue):
    def __init__(
        self,
        decode: DecodeFn,
        *,
        max_batch_size: int,
        batch_wait_s: float,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__("chat-scheduler")
        self._decode = decode
        self._max_batch_size = max_batch_size
        self._batch_wait_s = batch_wait_s
        self._on_batch = on_batch

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            batch, stopping = self._collect()
            if batch:
                self._run(batch)

    def _collect(self) -> tuple[list[tuple[GenerationRequest, Future]], bool]:
        """Wait for a first request, then gather more until the batch is full or the wait is over."""
        first = self._queue.get()
        if first is STOP:
            return [], True
        batch = [first]
        deadline = time.monotonic() + self._batch_wait_s
        while len(batch) < self._max_batch_size:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is STOP:
                return batch, True
            batch.append(item)
        return batch, False

    def _run(self, batch: list[tuple[GenerationRequest, Future]]) -> None:
        # A client that went away cancelled its future; its row is not decoded.
        live = [(req, fut) for req, fut in batch if fut.set_running_or_notify_cancel()]
        if not live:
            return
        if self._on_batch is not None:
            self._on_batch(len(live))
        started = time.monotonic()
        try:
            results = self._decode([req for req, _ in live])
        except Exception as exc:  # every request of the batch learns why it failed
            log.exception("decoding a batch of %d failed", len(live))
            for _, fut in live:
                fut.set_exception(exc)
            return
        for (_, fut), result in zip(live, results):
            fut.set_result(result)
        log.debug("decoded a batch of %d in %.3fs", len(live), time.monotonic() - started)
