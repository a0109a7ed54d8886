"""``draftline serve trainer``: an RQ worker on the train queue (train, export and evaluate jobs), or, with
``DRAFTLINE_TRAIN_NODE=join``, a training host that joins the multi-node trainings those jobs announce."""

from __future__ import annotations

import signal

from runtime import shutdown
from shared.jobs import TRAIN_QUEUE
from runtime.queues import connect
from shared.settings import TrainerSettings, configure_logging, load_settings
from runtime.worker import run_worker


def preload() -> None:
    """Import torch, transformers and the job modules once, before RQ forks a process per job."""
    import services.trainer.jobs  # noqa: F401


def main() -> None:
    settings = load_settings(TrainerSettings)
    if settings.train_node == "join":
        from services.trainer.launch import join_trainings

        configure_logging(settings.log_level)
        # The first SIGTERM stops the training it has joined at the next step boundary (every node's ranks agree
        # on it), then this node; a second one ends it at once.
        signal.signal(signal.SIGTERM, lambda signum, frame: (signal.signal(signal.SIGTERM, signal.SIG_DFL),
                                                             shutdown.request()))
        join_trainings(settings, connect(settings.redis_url), stop=shutdown.requested)
        return
    run_worker([TRAIN_QUEUE], settings, role="trainer", preload=preload)
