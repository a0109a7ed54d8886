"""``draftline serve generator``: an RQ worker on the generate queue."""

from __future__ import annotations

from services.generator import jobs
from shared.jobs import GENERATE_QUEUE
from shared.settings import GeneratorSettings, load_settings
from runtime.worker import run_worker


def main() -> None:
    settings = load_settings(GeneratorSettings)
    # Imported and its settings read here, before the first job: a forked job's process inherits the module
    # (and httpx with it) instead of importing it and parsing the environment again.
    run_worker([GENERATE_QUEUE], settings, role="generator", preload=jobs.worker_settings,
               job_process=settings.job_process)
