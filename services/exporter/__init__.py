"""Prometheus exporter: reads run counters, queues and workers from Redis, the volume and the GPUs at scrape time."""
