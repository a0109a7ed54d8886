"""``draftline serve exporter``: assemble the collector and serve it until SIGTERM."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.exporter.collector import DraftlineCollector, scrape_connection
from runtime.gpu import GpuReader
from services.exporter.server import make_app, serve, stop_event_on_signals
from shared.settings import ExporterSettings, configure_logging, load_settings


def main() -> None:
    settings = load_settings(ExporterSettings)
    configure_logging(settings.log_level)
    gpus = GpuReader()
    registry = CollectorRegistry()
    registry.register(DraftlineCollector(scrape_connection(settings.redis_url), settings.data, gpus=gpus))
    try:
        serve(make_app(registry), settings.host, settings.port, stop_event_on_signals())
    finally:
        gpus.close()
