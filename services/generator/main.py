"""``draftline serve generator``: an RQ worker on the generate queue."""

from __future__ import annotations

from shared.jobs import GENERATE_QUEUE
from shared.settings import GeneratorSettings, load_settings
from shared.worker import run_worker


def main() -> None:
    settings = load_settings(GeneratorSettings)
    run_worker([GENERATE_QUEUE], settings, role="generator")
