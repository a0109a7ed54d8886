"""Multi-process training for the train job: torchrun as a child of the job, its output forwarded to the
job's log, its failure turned into one named error.

torchrun runs as ``sys.executable -m torch.distributed.run`` rather than a ``torchrun`` found on PATH,
which may be missing or belong to another environment, with ``--standalone``: its rendezvous takes a
free local port, so trainers sharing a host never collide. The child gets the job's settings explicitly
and dies with the job (``PR_SET_PDEATHSIG``): the run's training lock is the job's, and a trainer left
running after its job was killed would write checkpoints beside the next one.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from collections import deque
from functools import partial
from pathlib import Path

import torch

from services.trainer.distributed import FAILURE_FILE, LOG_FILE
from services.trainer.train import pick_device
from shared.atomic import read_json
from shared.errors import DraftlineError, SettingsError
from runtime.process import die_with_parent, libc_prctl
from shared.settings import TrainerSettings

log = logging.getLogger(__name__)
output_log = logging.getLogger("services.trainer.torchrun")

TAIL_LINES = 20


class TrainingProcessFailed(DraftlineError):
    """A multi-process training run failed: the message names the rank that failed first with its error,
    torchrun's exit status, and ends with that rank's last lines and torchrun's own."""


def train_procs(settings: TrainerSettings) -> int:
    """How many processes train: DRAFTLINE_TRAIN_PROCS, where ``auto`` is one per visible GPU (1 on the CPU)."""
    on_gpu = pick_device(settings.device).type == "cuda"
    gpus = torch.cuda.device_count() if on_gpu else 0
    if settings.train_procs == "auto":
        return max(1, gpus)
    procs = int(settings.train_procs)
    if on_gpu and procs > gpus:
        raise SettingsError(f"DRAFTLINE_TRAIN_PROCS={procs}: only {gpus} GPUs are visible to the trainer (one rank per GPU)")
    return procs


def torchrun_command(run: str, procs: int, work_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
            "-m", "services.trainer.distributed", "--work-dir", str(work_dir), run]


def child_env(settings: TrainerSettings) -> dict[str, str]:
    """The job's environment with its settings spelled out, so every rank trains what the job means."""
    return {**os.environ, "DRAFTLINE_DATA": str(settings.data), "DRAFTLINE_MODEL_DIR": str(settings.model_dir),
            "DRAFTLINE_DEVICE": settings.device, "REDIS_URL": settings.redis_url,
            "DRAFTLINE_LOG_LEVEL": settings.log_level, "PYTHONUNBUFFERED": "1"}


def run_torchrun(run: str, procs: int, settings: TrainerSettings) -> None:
    """Train ``run`` in ``procs`` processes and return once all have finished; TrainingProcessFailed if any failed."""
    with tempfile.TemporaryDirectory(prefix="draftline-ranks-") as tmp:
        work_dir = Path(tmp)
        command = torchrun_command(run, procs, work_dir)
        log.info("run %s: training in %d processes: %s", run, procs, shlex.join(command))
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        libc_prctl()  # resolved here, so the forked child only makes the call (preexec_fn must take no locks)
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                              env=child_env(settings), preexec_fn=partial(die_with_parent, signal.SIGTERM)) as proc:  # noqa: PLW1509 (see above)
            assert proc.stdout is not None
            for line in proc.stdout:
                tail.append(line.rstrip("\n"))
                output_log.info("%s", tail[-1])
            code = proc.wait()
        if code != 0:
            raise failure(work_dir, procs, code, list(tail))


def last_lines(path: Path, count: int = TAIL_LINES) -> list[str]:
    if not path.is_file():
        return []
    with open(path, encoding="utf-8", errors="replace") as handle:
        return [line.rstrip("\n") for line in deque(handle, maxlen=count)]


def failure(work_dir: Path, procs: int, code: int, torchrun_tail: list[str]) -> TrainingProcessFailed:
    """The named error of a failed run. A rank that raises names its error; a rank killed by a signal (the
    out-of-memory killer, say) names nothing, and its peers then fail on the lost connection, so ranks
    without a report come first in the message and torchrun's summary, which names the signal, comes last."""
    status = f"torchrun exited with {code}" if code > 0 else f"torchrun was killed by signal {-code}"
    reports = sorted((read_json(path) for path in work_dir.glob(FAILURE_FILE.format(rank="*"))), key=lambda r: r["time"])
    silent = sorted(set(range(procs)) - {r["rank"] for r in reports})
    parts = []
    if silent:
        parts.append(f"ranks {silent} of {procs} ended without an error of their own (killed by a signal, or "
                     "stopped by torchrun after another rank failed; its summary below names the first)")
    if reports:
        first = reports[0]
        parts.append(f"rank {first['rank']} of {procs} failed first: {first['error_class']}: {first['message']}")
    message = "; ".join([*parts, status])
    if reports:
        rank_log = work_dir / LOG_FILE.format(rank=reports[0]["rank"])
        message += f"\nlast output of rank {reports[0]['rank']}:\n" + "\n".join(last_lines(rank_log))
    return TrainingProcessFailed(message + "\nlast output of torchrun:\n" + "\n".join(torchrun_tail))
