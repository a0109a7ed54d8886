"""``draftline serve extractor``: an RQ worker on the extract queue, tokenizer and end of turn loaded once before forking."""

from __future__ import annotations

import os

from services.extractor.jobs import preload
from services.extractor.sources import make_source
from shared.jobs import EXTRACT_QUEUE
from shared.settings import ExtractorSettings, load_settings
from runtime.worker import run_worker


def main() -> None:
    settings = load_settings(ExtractorSettings)
    # A hidden-state source that lacks a setting stops the worker here, naming it, instead of failing every job.
    make_source(settings, model="").close()
    # With job_process "fork" each job runs in a forked child, and the tokenizers library's thread pool does
    # not survive a fork; jobs tokenize one sample at a time, so inline loses nothing by it either.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_worker([EXTRACT_QUEUE], settings, role="extractor",
               preload=lambda: preload(str(settings.model_dir), settings.trust_remote_code),
               job_process=settings.job_process)
