"""What a worker that runs its jobs in its own process (``job_process = "inline"``) needs instead of a
work horse: someone to heartbeat while the job runs, and a cold stop that leaves the job to the reaper.

A forking worker heartbeats from its main loop while its horse works, and kills a horse that runs 60 s
past its job's timeout. An inline worker's main thread is the job, so ``JobHeartbeat`` does both from a
thread: it keeps the worker, the execution and the job alive in Redis every monitoring interval, and when
the job overruns its timeout by 60 s (a hang RQ's own timeout alarm did not end: it fires once, and a
per-sample boundary may catch it) it hands over to the worker, which fails the job by name as a forking
worker fails the horse it kills, records its own death and ends the process: a thread cannot stop the
main thread's job, and two copies of one job must never run.

The first SIGTERM requests a stop in this same process (``runtime.shutdown``), so a job that only waits gives
its unfinished work back at once instead of keeping the worker. A second SIGTERM raises ``ColdStop`` in the main
thread, inside the job; the worker lets it through its failure handling so the job stays started, as a killed
horse's does, and the worker's teardown records its death, which the reaper reads as "requeue now".
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from rq.job import Job
from rq.utils import now

log = logging.getLogger(__name__)

OVERRUN_GRACE_S = 60  # as RQ's forking worker: a horse is killed this long after its job's timeout
EXIT_OVERRAN = 70  # the exit status of an inline worker that ended itself over a job that overran


class ColdStop(SystemExit):
    """A second stop signal while an inline job runs: the job is cut short and left for the reaper."""


def overran_by(job: Job, grace_s: float = OVERRUN_GRACE_S) -> float | None:
    """Seconds ``job`` has run past its timeout plus ``grace_s``, None while it has not (or has no timeout)."""
    if job.timeout in (None, -1) or job.started_at is None:
        return None
    late = (now() - job.started_at).total_seconds() - job.timeout - grace_s
    return late if late > 0 else None


class JobHeartbeat:
    """A daemon thread that calls ``beat()`` every ``interval_s`` while a job runs in the main thread, and
    calls ``overrun()`` (which must not return: it ends the process) once the job has overrun."""

    def __init__(self, job: Job, interval_s: float, beat: Callable[[], None], overrun: Callable[[], None], *,
                 grace_s: float = OVERRUN_GRACE_S) -> None:
        self.job = job
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.beat = beat
        self.overrun = overrun
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{job.id}", daemon=True)

    def __enter__(self) -> JobHeartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            if overran_by(self.job, self.grace_s) is not None:
                self.overrun()
                return
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - a missed beat is retried at the next interval
                log.exception("job %s: heartbeat failed", self.job.id)


def end_process(status: int) -> None:
    """Leave at once, from any thread, with ``status``: no cleanup may run the job's code further."""
    logging.shutdown()
    os._exit(status)
