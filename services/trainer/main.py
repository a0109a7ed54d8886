"""``draftline serve trainer``: an RQ worker on the train queue (train, export and evaluate jobs)."""

from __future__ import annotations

from shared.jobs import TRAIN_QUEUE
from shared.settings import TrainerSettings, load_settings
from runtime.worker import run_worker


def preload() -> None:
    """Import torch, transformers and the job modules once, before RQ forks a process per job."""
    import services.trainer.jobs  # noqa: F401


def main() -> None:
    run_worker([TRAIN_QUEUE], load_settings(TrainerSettings), role="trainer", preload=preload)
