"""Training progress into the run's Redis metadata: what ``draftline status`` and the exporter read.

Both trainers use it: the train job when it trains in its own process, and rank 0 of a multi-process run.
"""

from __future__ import annotations

from services.trainer.session import ProgressFn, TrainProgress
from runtime.runstate import RunState
from shared.lifecycle import Stage


def progress_reporter(state: RunState) -> ProgressFn:
    """A progress callback writing train_done/total, loss, epoch, lr, tokens_per_s, epoch_padding, acc<k> and,
    where files are held out (train.validation_files), the latest held-out acceptance val_accept<k>."""

    def report(p: TrainProgress) -> None:
        accs = {f"acc{k}": round(a, 4) for k, a in enumerate(p.acc)}
        held_out = {f"val_accept{k}": round(v, 4) for k, v in (p.validation or {}).items()}
        state.set_progress(Stage.TRAIN, p.step, p.total, loss=round(p.loss, 5), epoch=p.epoch, lr=p.lr,
                           tokens_per_s=round(p.tokens_per_s, 1),
                           epoch_padding=round(p.padding, 4), **accs, **held_out)

    return report
