"""One rank of a multi-process (DDP) training run, as the train job starts it (launch.py):

    python -m torch.distributed.run --standalone --nproc-per-node N -m services.trainer.distributed --work-dir DIR RUN

torchrun gives each process RANK, LOCAL_RANK, WORLD_SIZE and the rendezvous in its environment; the
settings come from the environment as in the worker. A rank joins the process group (NCCL on GPU
LOCAL_RANK, gloo on the CPU), trains its slice of every global batch (train.py) and leaves the group.
Rank 0 alone reports progress to Redis and writes the training log and checkpoints; the job exports from
the last checkpoint once every rank has exited.

torchrun starts each rank in a session of its own, so a signal to the job's process group (RQ kills a
timed-out job's work horse that way) would never reach it: a rank therefore asks the kernel for SIGTERM
when torchrun ends, and torchrun for SIGTERM when the job ends, so no rank outlives its job.

Each rank logs to stderr (which torchrun passes up to the job) and to ``DIR/rank<N>.log``; a rank that
fails also writes ``DIR/failure_rank<N>.json``, so the job can name the first failure and show that
rank's own last lines rather than those of the ranks torchrun stopped after it.

A stop asked of the job (the worker's first SIGTERM) reaches the ranks as ``DIR/stop``, which each looks for at
every step: they agree on it at the step's all-reduce, rank 0 checkpoints there, rank 0 writes
``DIR/stopped.json``, and every rank exits 0; the job then yields (``train.TrainingStopped``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from services.trainer.progress import progress_reporter
from services.trainer.session import pick_device
from services.trainer.train import TrainingStopped, train_drafter
from shared.atomic import atomic_write_json
from shared.errors import SettingsError, error_class
from runtime.process import die_with_parent
from runtime.disk import StageHold
from runtime.queues import connect
from shared.runspec import RunSpec
from runtime.runstate import RunState
from shared.lifecycle import Stage
from shared.settings import TrainerSettings, load_settings

log = logging.getLogger(__name__)

LOG_FILE = "rank{rank}.log"
FAILURE_FILE = "failure_rank{rank}.json"
STOP_FILE = "stop"  # the job asks the ranks to stop at their next step boundary (launch.request_rank_stop)
STOPPED_FILE = "stopped.json"  # rank 0: training stopped at a step boundary, its checkpoint there
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="services.trainer.distributed", description="One rank of a DDP training run.")
    parser.add_argument("run", help="the run to train")
    parser.add_argument("--work-dir", type=Path, required=True, help="where each rank writes its log and failure")
    return parser.parse_args(argv)


def torchrun_ranks() -> tuple[int, int]:
    """(RANK, LOCAL_RANK) from the environment torchrun sets up."""
    try:
        return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    except (KeyError, ValueError):
        raise SettingsError("RANK and LOCAL_RANK are unset: start this module through torch.distributed.run") from None


def configure_rank_logging(level: str, rank: int, work_dir: Path) -> None:
    handlers = [logging.StreamHandler(sys.stderr), logging.FileHandler(work_dir / LOG_FILE.format(rank=rank))]
    logging.basicConfig(level=getattr(logging, level, logging.INFO), handlers=handlers, force=True,
                        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")


def rank_device(device: str, local_rank: int) -> torch.device:
    """This rank's device: its own GPU (LOCAL_RANK of those visible), or the CPU."""
    dev = pick_device(device)
    if dev.type != "cuda":
        return dev
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def train_rank(run: str, settings: TrainerSettings, rank: int, local_rank: int, work_dir: Path) -> None:
    device = rank_device(settings.device, local_rank)
    # The timeout bounds every collective: a rank whose peer's node is gone fails by name instead of hanging.
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                            timeout=timedelta(seconds=settings.train_timeout_s))
    try:
        log.info("rank %d of %d (pid %d) training %s on %s", rank, dist.get_world_size(), os.getpid(), run, device)
        spec = RunSpec.load(settings.data, run)
        conn = connect(settings.redis_url)
        progress = progress_reporter(RunState(conn, settings.data, run)) if rank == 0 else None
        # Rank 0 writes the checkpoints; its peers wait for it at the next collective, within the train timeout.
        hold = StageHold(conn, run, Stage.TRAIN) if rank == 0 else None
        stop = partial(stop_asked, work_dir)
        try:
            result = train_drafter(spec, data=settings.data, model_dir=settings.model_dir, device=str(device),
                                   progress=progress, space_hold=hold, state=RunState(conn, settings.data, run),
                                   stop=stop, trust_remote_code=settings.trust_remote_code)
        except TrainingStopped as exc:  # every rank stopped after the same step (the flag rides on its all-reduce)
            dist.barrier()  # rank 0's checkpoint is written
            if rank == 0:
                atomic_write_json(work_dir / STOPPED_FILE, {"message": str(exc), "time": time.time()})
            log.info("rank %d stopped: %s", rank, exc)
            return
        # Every rank tears down together, after rank 0 has written the last checkpoint: a gloo rank that destroyed
        # its process group while its peer was still busy aborted at exit ("terminate called without an active
        # exception"), and the peer's torchrun then waited out its exit barrier for the node that never came.
        dist.barrier()
        log.info("rank %d done at step %d", rank, result.steps)
    finally:
        dist.destroy_process_group()


def stop_asked(work_dir: Path) -> bool:
    """The job (or a joining node's process) asked the ranks to stop: its stop file is in the ranks' folder."""
    return (work_dir / STOP_FILE).exists()


def write_failure(work_dir: Path, rank: int, exc: BaseException) -> None:
    atomic_write_json(work_dir / FAILURE_FILE.format(rank=rank),
                      {"rank": rank, "error_class": error_class(exc), "message": str(exc), "time": time.time()})


def main(argv: list[str] | None = None) -> int:
    die_with_parent(signal.SIGTERM)  # exits if torchrun has already ended
    args = parse_args(argv)
    rank, local_rank = torchrun_ranks()
    try:
        settings = load_settings(TrainerSettings)
        configure_rank_logging(settings.log_level, rank, args.work_dir)
        train_rank(args.run, settings, rank, local_rank, args.work_dir)
    except Exception as exc:  # the rank's outer loop: name the failure for the job, then exit non-zero
        log.exception("rank %d failed", rank)
        write_failure(args.work_dir, rank, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
