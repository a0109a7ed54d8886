"""What a running server holds: the loaded target and the two workers that use it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from services.inference.continuous import ContinuousScheduler
from services.inference.decode import generate_batch
from services.inference.metrics import InferenceMetrics
from services.inference.model import LoadedModel
from services.inference.pipeline import HiddenStatePipeline
from services.inference.scheduler import ChatScheduler, RequestQueue
from services.inference.slots import SlotModel, UnsupportedTarget, kv_bytes_per_token, unsupported_reason
from shared.settings import InferenceSettings

log = logging.getLogger(__name__)

CHAT_ENDPOINT = "/v1/chat/completions"
HIDDEN_ENDPOINT = "/v1/hidden_states"


@dataclass
class Runtime:
    settings: InferenceSettings
    loaded: LoadedModel
    metrics: InferenceMetrics
    scheduler: RequestQueue
    pipeline: HiddenStatePipeline
    started: int = field(default_factory=lambda: int(time.time()))

    def stop(self) -> None:
        log.info("draining chat and hidden-state work")
        self.scheduler.stop()
        self.pipeline.stop()
        log.info("inference runtime stopped")


def chat_decoder(settings: InferenceSettings, loaded: LoadedModel, metrics: InferenceMetrics) -> RequestQueue:
    """The continuous decoder where settings and target allow it, else the per-batch one."""
    on_batch = metrics.batch_size.labels(CHAT_ENDPOINT).observe
    reason = unsupported_reason(loaded)
    wanted = settings.decoder == "continuous" or (settings.decoder == "auto" and loaded.device.type == "cuda")
    if wanted and reason is None:
        long = long_pool(settings, loaded)
        slots = affordable_slots(settings, loaded)
        model = SlotModel(loaded, slots=slots, slot_tokens=settings.slot_tokens, cuda_graphs=settings.cuda_graphs)
        for pool in (model, long):
            if pool is not None:
                pool.capture()
        return ContinuousScheduler(model, prefill_tokens=settings.prefill_tokens, long=long, on_step=on_batch)
    if settings.decoder == "continuous":
        raise UnsupportedTarget(f"DRAFTLINE_DECODER=continuous, but {reason}")
    if wanted:
        log.info("chat decoding one batch at a time: %s", reason)
    return ChatScheduler(lambda requests: generate_batch(loaded, requests), max_batch_size=settings.max_batch_size,
                         batch_wait_s=settings.batch_wait_ms / 1000.0, on_batch=on_batch)


LONG_SLOT_CAP = 32768


def long_pool(settings: InferenceSettings, loaded: LoadedModel) -> SlotModel | None:
    """``long_slots`` slots of ``long_slot_tokens`` (the context length by default, capped) for requests a short
    slot cannot hold; none where they would be no longer than the short ones. Made first: the short slots
    take what memory is left."""
    length = settings.long_slot_tokens or min(loaded.context_length, LONG_SLOT_CAP)
    if settings.long_slots == 0 or length <= settings.slot_tokens:
        return None
    return SlotModel(loaded, slots=settings.long_slots, slot_tokens=length, cuda_graphs=settings.cuda_graphs)


def affordable_slots(settings: InferenceSettings, loaded: LoadedModel) -> int:
    """``decode_slots``, fewer where their KV cache would take more than ``kv_cache_fraction`` of the free
    GPU memory (the hidden-state forwards need the rest)."""
    if loaded.device.type != "cuda":
        return settings.decode_slots
    free, _ = torch.cuda.mem_get_info(loaded.device)
    per_slot = settings.slot_tokens * kv_bytes_per_token(loaded)
    slots = min(settings.decode_slots, int(free * settings.kv_cache_fraction) // per_slot)
    if slots < 1:
        raise UnsupportedTarget(f"one slot of {settings.slot_tokens} positions needs {per_slot} bytes, more than "
                                f"{settings.kv_cache_fraction} of the {free} bytes free: lower DRAFTLINE_SLOT_TOKENS")
    if slots < settings.decode_slots:
        log.warning("KV cache for %d slots only (DRAFTLINE_DECODE_SLOTS=%d): %d bytes free, fraction %.2f", slots,
                    settings.decode_slots, free, settings.kv_cache_fraction)
    return slots


def start_runtime(settings: InferenceSettings, loaded: LoadedModel, metrics: InferenceMetrics) -> Runtime:
    scheduler = chat_decoder(settings, loaded, metrics)
    pipeline = HiddenStatePipeline(
        loaded,
        batch_tokens=settings.hidden_batch_tokens,
        writer_threads=settings.writer_threads,
        on_batch=metrics.batch_size.labels(HIDDEN_ENDPOINT).observe,
        on_written=metrics.hidden_state_bytes.inc,
    )
    return Runtime(settings, loaded, metrics, scheduler.start(), pipeline.start())
