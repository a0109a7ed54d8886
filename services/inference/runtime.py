"""What a running server holds: the loaded target and the two workers that use it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from services.inference.decode import generate_batch
from services.inference.metrics import InferenceMetrics
from services.inference.model import LoadedModel
from services.inference.pipeline import HiddenStatePipeline
from services.inference.scheduler import ChatScheduler
from shared.settings import InferenceSettings

log = logging.getLogger(__name__)

CHAT_ENDPOINT = "/v1/chat/completions"
HIDDEN_ENDPOINT = "/v1/hidden_states"


@dataclass
class Runtime:
    settings: InferenceSettings
    loaded: LoadedModel
    metrics: InferenceMetrics
    scheduler: ChatScheduler
    pipeline: HiddenStatePipeline
    started: int = field(default_factory=lambda: int(time.time()))

    def stop(self) -> None:
        log.info("draining chat and hidden-state work")
        self.scheduler.stop()
        self.pipeline.stop()
        log.info("inference runtime stopped")


def start_runtime(settings: InferenceSettings, loaded: LoadedModel, metrics: InferenceMetrics) -> Runtime:
    scheduler = ChatScheduler(
        lambda requests: generate_batch(loaded, requests),
        max_batch_size=settings.max_batch_size,
        batch_wait_s=settings.batch_wait_ms / 1000.0,
        on_batch=metrics.batch_size.labels(CHAT_ENDPOINT).observe,
    )
    pipeline = HiddenStatePipeline(
        loaded,
        batch_tokens=settings.hidden_batch_tokens,
        writer_threads=settings.writer_threads,
        on_batch=metrics.batch_size.labels(HIDDEN_ENDPOINT).observe,
        on_written=metrics.hidden_state_bytes.inc,
    )
    return Runtime(settings, loaded, metrics, scheduler.start(), pipeline.start())
