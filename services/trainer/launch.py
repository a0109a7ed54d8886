"""Multi-process training for the train job: torchrun as a child of the job, its output forwarded to the
job's log, its failure turned into one named error.

torchrun runs as ``sys.executable -m torch.distributed.run`` rather than a ``torchrun`` found on PATH,
which may be missing or belong to another environment, with ``--standalone``: its rendezvous takes a
free local port, so trainers sharing a host never collide. Across hosts it runs as one node of torchrun's
c10d rendezvous instead (``rendezvous.py``). The child gets the job's settings explicitly
and dies with the job (``PR_SET_PDEATHSIG``): the run's training lock is the job's, and a trainer left
running after its job was killed would write checkpoints beside the next one.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path

import redis
import torch

from runtime import shutdown
from services.trainer.distributed import FAILURE_FILE, LOG_FILE, STOP_FILE, STOPPED_FILE
from services.trainer.rendezvous import (
    POLL_S,
    Rendezvous,
    announce,
    announced,
    check_hostable,
    check_reachable,
    rank_dir,
    torchrun_args,
    withdraw,
)
from services.trainer.session import pick_device
from services.trainer.train import TrainingStopped
from shared.atomic import read_json
from shared.errors import DraftlineError, SettingsError, error_class
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


def torchrun_command(run: str, procs: int, work_dir: Path, node: list[str] | None = None) -> list[str]:
    """The command that trains ``run`` in ``procs`` local processes: alone (``--standalone``), or as one node
    of a multi-node training (``node``: ``rendezvous.torchrun_args``)."""
    return [sys.executable, "-m", "torch.distributed.run", *(node or ["--standalone"]), f"--nproc-per-node={procs}",
            "-m", "services.trainer.distributed", "--work-dir", str(work_dir), run]


def child_env(settings: TrainerSettings) -> dict[str, str]:
    """The job's environment with its settings spelled out, so every rank trains what the job means."""
    return {**os.environ, "DRAFTLINE_DATA": str(settings.data), "DRAFTLINE_MODEL_DIR": str(settings.model_dir),
            "DRAFTLINE_DEVICE": settings.device, "REDIS_URL": settings.redis_url,
            "DRAFTLINE_LOG_LEVEL": settings.log_level, "DRAFTLINE_TRAIN_TIMEOUT_S": repr(settings.train_timeout_s),
            "PYTHONUNBUFFERED": "1"}


def run_torchrun(run: str, procs: int, settings: TrainerSettings, rendezvous: Rendezvous | None = None, *,
                 host: bool = True) -> None:
    """Train ``run`` in ``procs`` processes and return once all have finished; TrainingProcessFailed if any failed.

    With ``rendezvous``, this host is one node of a multi-node training (``host``: the train job's, which hosts
    the rendezvous); the ranks of every node then report to the run's folder on the shared volume."""
    if rendezvous is None:
        with tempfile.TemporaryDirectory(prefix="draftline-ranks-") as tmp:
            _torchrun(torchrun_command(run, procs, Path(tmp)), settings, Path(tmp), list(range(procs)))
        return
    work_dir = rank_dir(settings.data, rendezvous)
    work_dir.mkdir(parents=True, exist_ok=True)
    node = torchrun_args(rendezvous, host=host, timeout_s=settings.train_timeout_s, local_addr=settings.train_node_addr)
    try:
        _torchrun(torchrun_command(run, procs, work_dir, node), settings, work_dir, None)
    finally:
        if host:  # every node has finished, and a failure has been named: nothing is left to read
            shutil.rmtree(work_dir, ignore_errors=True)


def train_across_nodes(run: str, procs: int, settings: TrainerSettings, conn: redis.Redis) -> None:
    """The train job's node of a multi-node training: announce it (the other nodes join it), train, withdraw it."""
    rendezvous = Rendezvous.new(run, settings.train_rdzv_endpoint or "", settings.train_nodes)
    check_hostable(rendezvous)
    announce(conn, rendezvous)
    log.info("run %s: training on %d nodes, rendezvous %s at %s; waiting up to %.0fs for the other nodes", run,
             rendezvous.nodes, rendezvous.id, rendezvous.endpoint, settings.train_timeout_s)
    try:
        run_torchrun(run, procs, settings, rendezvous, host=True)
    finally:
        withdraw(conn, rendezvous)


def join_trainings(settings: TrainerSettings, conn: redis.Redis, *, stop: Callable[[], bool] = lambda: False) -> None:
    """A joining node (``DRAFTLINE_TRAIN_NODE=join``): join every training the train job announces, one at a
    time, until ``stop``. A training that fails is logged and left to the job, which names it and retries."""
    joined: set[str] = set()
    procs = train_procs(settings)
    log.info("trainer node: %d processes; waiting for a multi-node training to join", procs)
    while not stop():
        try:
            rendezvous = announced(conn)
        except redis.RedisError as exc:  # Redis restarting: this node keeps waiting, as RQ workers do
            log.warning("trainer node: Redis unreachable (%s); waiting", exc)
            time.sleep(POLL_S * 5)
            continue
        if rendezvous is None or rendezvous.id in joined:
            time.sleep(POLL_S)
            continue
        joined.add(rendezvous.id)
        log.info("run %s: joining training %s at %s", rendezvous.run, rendezvous.id, rendezvous.endpoint)
        try:
            check_reachable(rendezvous, settings.train_timeout_s)
            run_torchrun(rendezvous.run, procs, settings, rendezvous, host=False)
            log.info("run %s: training %s finished on this node", rendezvous.run, rendezvous.id)
        except TrainingStopped as exc:
            log.info("run %s: training %s stopped at a step boundary: %s", rendezvous.run, rendezvous.id, exc)
        except DraftlineError as exc:
            log.error("run %s: training %s failed on this node: %s: %s", rendezvous.run, rendezvous.id,
                      error_class(exc), exc)


def _torchrun(command: list[str], settings: TrainerSettings, work_dir: Path, ranks: list[int] | None) -> None:
    """Run torchrun to its end; a stop asked of this process meanwhile reaches the ranks as their stop file, and a
    training they stopped at a step boundary raises ``TrainingStopped`` here."""
    log.info("training in processes: %s", shlex.join(command))
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    libc_prctl()  # resolved here, so the forked child only makes the call (preexec_fn must take no locks)
    with shutdown.forwarded(partial(request_rank_stop, work_dir)), \
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                             env=child_env(settings), preexec_fn=partial(die_with_parent, signal.SIGTERM)) as proc:  # noqa: PLW1509 (see above)
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            output_log.info("%s", tail[-1])
        code = proc.wait()
    if code != 0:
        raise failure(work_dir, ranks, code, list(tail))
    stopped = work_dir / STOPPED_FILE
    if stopped.is_file():
        raise TrainingStopped(read_json(stopped)["message"])


def request_rank_stop(work_dir: Path) -> None:
    """Ask the ranks to stop at their next step boundary: each looks for this file at every step."""
    (work_dir / STOP_FILE).touch()


def last_lines(path: Path, count: int = TAIL_LINES) -> list[str]:
    if not path.is_file():
        return []
    with open(path, encoding="utf-8", errors="replace") as handle:
        return [line.rstrip("\n") for line in deque(handle, maxlen=count)]


def failure(work_dir: Path, ranks: list[int] | None, code: int, torchrun_tail: list[str]) -> TrainingProcessFailed:
    """The named error of a failed run. A rank that raises names its error; a rank killed by a signal (the
    out-of-memory killer, say) names nothing, and its peers then fail on the lost connection, so ranks
    without a report come first in the message and torchrun's summary, which names the signal, comes last.
    ``ranks``: every rank of the run; None across nodes, where the ranks that started (each writes its log
    first) stand for them."""
    status = f"torchrun exited with {code}" if code > 0 else f"torchrun was killed by signal {-code}"
    reports = sorted((read_json(path) for path in work_dir.glob(FAILURE_FILE.format(rank="*"))), key=lambda r: r["time"])
    if ranks is None:
        ranks = sorted(int(path.stem.removeprefix("rank")) for path in work_dir.glob(LOG_FILE.format(rank="*")))
    silent = sorted(set(ranks) - {r["rank"] for r in reports})
    parts = []
    if silent:
        parts.append(f"ranks {silent} of {len(ranks)} ended without an error of their own (killed by a signal, or "
                     "stopped by torchrun after another rank failed; its summary below names the first)")
    if reports:
        first = reports[0]
        parts.append(f"rank {first['rank']} of {len(ranks)} failed first: {first['error_class']}: {first['message']}")
    message = "; ".join([*parts, status])
    if reports:
        rank_log = work_dir / LOG_FILE.format(rank=reports[0]["rank"])
        message += f"\nlast output of rank {reports[0]['rank']}:\n" + "\n".join(last_lines(rank_log))
    return TrainingProcessFailed(message + "\nlast output of torchrun:\n" + "\n".join(torchrun_tail))
