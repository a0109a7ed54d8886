"""Prometheus metrics of one app. Each app owns its registry, so several apps can live in one process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from shared.metrics import (
    INFERENCE_BATCH_SIZE,
    INFERENCE_GENERATED_TOKENS,
    INFERENCE_HIDDEN_STATE_BYTES,
    INFERENCE_REQUEST_DURATION,
    INFERENCE_REQUESTS,
)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class InferenceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.request_duration = Histogram(
            INFERENCE_REQUEST_DURATION, "Time from request to response, by route.", ["endpoint"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.requests = Counter(INFERENCE_REQUESTS, "Requests answered, by route and HTTP status.", ["endpoint", "status"],
                                registry=self.registry)
        self.generated_tokens = Counter(INFERENCE_GENERATED_TOKENS, "Completion tokens generated.", registry=self.registry)
        self.batch_size = Histogram(
            INFERENCE_BATCH_SIZE, "Requests per batch: chat rows decoded together (per decode step when decoding "
            "continuously), samples per hidden-state forward.",
            ["endpoint"], buckets=BATCH_BUCKETS, registry=self.registry,
        )
        self.hidden_state_bytes = Counter(INFERENCE_HIDDEN_STATE_BYTES, "Bytes of hidden-state files written.",
                                          registry=self.registry)

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.request_duration.labels(endpoint).observe(seconds)
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
