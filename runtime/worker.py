"""Start an RQ worker the way every draftline worker service does: JSON serializer, named, logged.

Stopping: the first SIGTERM (or SIGINT) lets the current job finish, then the worker exits 0; a second
one, more than a second later, kills the job's work horse and exits at once, leaving the job started
for the controller's reaper to requeue. A job that is only waiting (for an inference server that is down, for
disk space, for room in an online run's budget) does not keep the worker: the first signal reaches the job's
process (``runtime.shutdown``: in-process inline, ``HORSE_SIGNAL`` to the work horse alone when forking), the
job gives its unfinished samples back within ``shutdown.DRAIN_DEADLINE_S`` by raising ``JobYielded``, and the
worker puts it back at the front of its queue, neither failed nor counted as a requeue or a retry, and exits.
A worker that dies outright (SIGKILL, a lost host) stops heartbeating; its work horse dies with it, and the
reaper requeues the job once the heartbeat is stale.

A worker runs each job in a forked work horse (``job_process = "fork"``, RQ's way) or in its own process
(``"inline"``, ``runtime.inline_jobs``): no fork, and the job's modules, caches, HTTP and Redis clients
kept from one job to the next. Inline, a thread heartbeats while the job runs, a second SIGTERM cuts the
job short and leaves it started for the reaper, and a job 60 s past its timeout fails by name and ends the
worker (whose restart policy brings it back), since nothing can stop a hung job in its own process.

A worker whose data directory is not the controller's volume (``runtime.volume``) refuses at start-up and
before every job: it hands the job it just took back to the front of its queue, stops, and exits with
``VolumeMismatch`` naming both volumes, instead of writing files that nobody reads.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Literal, TypeVar

import redis
from rq import Queue, Worker, worker_registration
from rq.exceptions import (
    DeserializationError,
    InvalidJobOperation,
    NoSuchJobError,
    StopRequested,
)
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.job_lifecycle import record_job_failure
from rq.utils import now
from rq.worker import WorkerStatus

from shared.errors import ForeignJob
from runtime.inline_jobs import EXIT_OVERRAN, OVERRUN_GRACE_S, ColdStop, JobHeartbeat, end_process, overran_by
from shared.jobs import JOB_FUNCS
from runtime.outage import REDIS_DOWN, RedisOutage
from runtime.process import die_with_parent
from runtime.queues import SERIALIZER, connect, queue
from runtime import shutdown
from runtime.requeue import requeue_lost, requeue_yielded
from runtime.retry import preload_http, tls_context
from shared.settings import CommonSettings, configure_logging
from runtime.volume import VolumeMismatch, verify_volume

log = logging.getLogger(__name__)
T = TypeVar("T")

# A busy worker heartbeats every JOB_MONITORING_INTERVAL_S (RQ's default is 30 s); the reaper calls a
# worker dead after STALE_HEARTBEAT_S without one, so a killed worker's job is back on its queue within
# about 40 s instead of RQ's own 10-minute maintenance.
JOB_MONITORING_INTERVAL_S = 10
STALE_HEARTBEAT_S = 3 * JOB_MONITORING_INTERVAL_S
# An idle worker heartbeats every WORKER_TTL_S - 15 s (its blocking dequeue's timeout) and vanishes from
# the worker list WORKER_TTL_S + 60 s after its last one (RQ's default TTL is 420 s).
WORKER_TTL_S = 60
START_WAIT_S = 300.0  # how long a starting worker waits for Redis before it gives up
UNSUBSCRIBE_WAIT_S = 5.0  # how long a stopping worker waits for its command channel's thread to end


def hand_back(job: Job, q: Queue) -> None:
    """Return a dequeued job that has not started to the front of its queue, as if never taken.

    RQ moves a job from its single queue to an intermediate list when a worker takes it; the job is
    still ``queued`` until its work horse starts, so putting the id back is all that undoes the take."""
    pipe = q.connection.pipeline(transaction=True)
    pipe.lrem(q.intermediate_queue_key, 1, job.id)
    pipe.lpush(q.key, job.id)
    pipe.execute()


class DraftlineWorker(Worker):
    """RQ's forking worker, made to keep going: a work horse that dies with its worker, a volume check
    before each job, a killed work horse's job requeued instead of failed, and Redis outages waited out."""

    data: Path | None = None  # the data directory to check against the controller's volume; None: no check
    refused: VolumeMismatch | None = None
    inline: bool = False  # run jobs in this process (runtime.inline_jobs) instead of a forked work horse
    overrun_grace_s: float = OVERRUN_GRACE_S  # inline: how long past its timeout a job may run

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outage = RedisOutage(f"worker {self.name}")
        self._horse_lost: str | None = None  # how the current job's work horse was lost, when it was

    def setup_work_horse_signals(self) -> None:
        super().setup_work_horse_signals()
        die_with_parent()

    # ---- the first stop signal reaches the job -----------------------------------------------------
    def _install_signal_handlers(self) -> None:
        super()._install_signal_handlers()
        if not self.inline:
            # Before the first fork, so a work horse has the handler from its first instruction: without it the
            # signal's default action would kill the horse.
            shutdown.install_horse_handler()

    def handle_warm_shutdown_request(self) -> None:
        super().handle_warm_shutdown_request()
        if self.inline:
            shutdown.request()
        elif self.horse_pid:
            self.signal_horse()

    def fork_work_horse(self, job: Job, queue: Queue) -> None:
        # The horse learns of a stop from its worker's signal alone: a HORSE_SIGNAL sent to the worker itself must
        # not reach every later horse through the fork.
        shutdown.clear()
        super().fork_work_horse(job, queue)
        if self._stop_requested:  # the signal came between the fork and the horse's pid being known
            self.signal_horse()

    def signal_horse(self) -> None:
        """Pass the stop request to the work horse, and to it alone: its process group also holds what the job
        started (torchrun and its ranks), which must not get the signal."""
        try:
            os.kill(self.horse_pid, shutdown.HORSE_SIGNAL)
        except ProcessLookupError:
            pass  # the horse has ended meanwhile

    # ---- one job ----------------------------------------------------------------------------------
    def execute_job(self, job: Job, queue: Queue) -> None:
        if job_function(job) not in JOB_FUNCS.get(queue.name, ()):
            refuse_foreign(job, queue)
            return
        if self.data is not None:
            try:
                verify_volume(self.data, self.connection)
            except redis.RedisError as exc:
                # The job cannot reach Redis either; it fails and is requeued the usual way.
                log.warning("worker %s: volume not checked before job %s: %s", self.name, job.id, exc)
            except VolumeMismatch as exc:
                hand_back(job, queue)
                log.error("worker %s: job %s handed back untouched: %s", self.name, job.id, exc)
                self.refused = exc
                raise StopRequested() from None
        try:
            if self.inline:
                self.execute_inline(job, queue)
            else:
                super().execute_job(job, queue)
        except REDIS_DOWN as exc:
            # Redis went away while the job was taken, run or settled: wait for it, then make sure the
            # job is either settled or queued again (the volume, not this process, knows what was done).
            self.outage.down(exc)
            self.wait_for_redis()
            self.settle_after_outage(job, queue)

    def execute_inline(self, job: Job, queue: Queue) -> None:
        """Run ``job`` in this process, heartbeating from a thread as a forking worker does from its loop."""
        execution = self.prepare_execution(job)
        with JobHeartbeat(job, self.job_monitoring_interval, beat=lambda: self.maintain_heartbeats(job, execution),
                          overrun=lambda: self.fail_overrun(job, queue, execution), grace_s=self.overrun_grace_s):
            self.perform_job(job, queue, execution)
        self.set_state(WorkerStatus.IDLE)

    def fail_overrun(self, job: Job, queue: Queue, execution: Execution) -> None:
        """From the heartbeat thread: fail an inline job that overran its timeout, as a forking worker fails
        the horse it kills for it, then end this process, whose main thread is still inside the job."""
        late = overran_by(job, self.overrun_grace_s) or 0.0
        message = (f"JobTimeoutException: job {job.id} ran {late:.0f}s past its timeout of {job.timeout}s plus "
                   f"{self.overrun_grace_s:g}s; worker {self.name} ran it inline and ends itself to stop it")
        log.error("%s", message)
        try:
            # The claim, as in the reaper: a job that settled meanwhile is no longer in the registry.
            if self.connection.zrem(job.started_job_registry.key, execution.composite_key):
                self.handle_job_failure(job, queue, exc_string=message, execution=execution)
            self.register_death()
        except REDIS_DOWN as exc:
            log.error("worker %s: could not record the overrun in redis (the reaper requeues the job): %s",
                      self.name, exc)
        end_process(EXIT_OVERRAN)

    def request_force_stop(self, signum, frame) -> None:
        if not self.inline:
            super().request_force_stop(signum, frame)
            return
        # As RQ's: a second signal within a second of the first is a duplicate (a pool's and the terminal's).
        if self._shutdown_requested_date and now() - self._shutdown_requested_date < timedelta(seconds=1):
            return
        log.warning("Worker %s: cold shut down", self.name)
        raise ColdStop()

    def _finalize_success(self, job: Job, queue: Queue, execution: Execution, return_value) -> None:
        try:
            super()._finalize_success(job, queue, execution, return_value)
        except (InvalidJobOperation, NoSuchJobError) as exc:
            # Every job RQ queues has a status: none means Redis lost the record (flushed, or restarted
            # empty) while the job ran; what is there now is at most the heartbeat's own few fields.
            if self.connection.hexists(job.key, "status"):
                raise
            # The job ran to its end: its samples' outcomes are on the volume, which the controller's
            # rebuild reads. Failing it would write a failed record of a finished job into the new Redis,
            # and the controller would name the samples its rebuild had just sent back to be redone as
            # failures of that job.
            self.connection.delete(job.key)
            log.warning("worker %s: job %s ran to its end, but Redis no longer holds its record (%s); "
                        "left to the controller's rebuild, not failed", self.name, job.id, exc)

    def _finalize_failure(self, job: Job, queue: Queue, execution: Execution, exc_info) -> None:
        # A cold stop is no failure of the job: it stays started, and the teardown's death record tells the
        # reaper to requeue it, as it does a killed horse's.
        if isinstance(exc_info[1], ColdStop):
            raise exc_info[1]
        if isinstance(exc_info[1], shutdown.JobYielded):
            self.give_back(job, queue, execution, exc_info[1])
            return
        super()._finalize_failure(job, queue, execution, exc_info)

    def give_back(self, job: Job, queue: Queue, execution: Execution, exc: shutdown.JobYielded) -> None:
        """Put a job that yielded back at the front of its queue: not failed, and counted neither as a requeue
        nor as a retry. Forking, this runs in the work horse, which then exits 0 like a job that succeeded."""
        # The execution still registered as started is the claim, as in the reaper: a reaper that took this worker
        # for dead and requeued the job already must not see it queued twice.
        if requeue_yielded(job, queue, execution, cause=str(exc)):
            self.executions.pop(execution.id, None)
        else:
            log.warning("worker %s: job %s yielded, but its execution is no longer registered (the reaper requeued "
                        "it, or Redis lost it); left as it is", self.name, job.id)

    def settle_after_outage(self, job: Job, queue: Queue) -> None:
        """Requeue ``job`` if Redis still holds it unsettled; a Redis that came back empty lost it, and the
        controller rebuilds its queues from the volume."""
        if self.horse_pid:
            # Never two copies of one job: a horse still running (the outage cut its monitoring short)
            # is stopped before the job can be queued again.
            self.kill_horse()
            self.wait_for_horse()
            self._horse_pid = 0
        try:
            status = job.get_status(refresh=True)
        except (InvalidJobOperation, NoSuchJobError):
            return
        if status not in (JobStatus.STARTED, JobStatus.QUEUED):
            return
        with self.connection.pipeline() as pipe:
            for execution in list(self.executions.values()):
                if execution.job_id == job.id:
                    self.cleanup_execution(job, pipeline=pipe, execution=execution)
            pipe.execute()
        requeue_lost(job, queue, cause=f"redis was unreachable while worker {self.name} ran it")

    # ---- a work horse killed by a signal (the OOM killer's SIGKILL) is requeued, not failed -----------
    def handle_work_horse_killed(self, job: Job, retpid, ret_val, rusage) -> None:
        super().handle_work_horse_killed(job, retpid, ret_val, rusage)
        self._horse_lost = horse_loss(job, ret_val)

    def handle_job_failure(self, job: Job, queue: Queue, started_job_registry=None, exc_string: str = "",
                           execution: Execution | None = None) -> None:
        lost, self._horse_lost = self._horse_lost, None
        if lost is None or execution is None:
            super().handle_job_failure(job, queue, started_job_registry, exc_string, execution)
            return
        # Taking the execution off the started registry is the claim, as in the reaper: whoever removes
        # it requeues, so a reaper that took this worker for dead cannot queue the job a second time.
        if not self.connection.zrem(job.started_job_registry.key, execution.composite_key):
            return
        with self.connection.pipeline() as pipe:
            self.cleanup_execution(job, pipeline=pipe, execution=execution)
            pipe.execute()
        requeue_lost(job, queue, cause=f"work horse of worker {self.name} {lost}")

    # ---- Redis outages: every call of the work loop waits Redis out instead of ending the worker -------
    def wait_for_redis(self) -> None:
        self.outage.wait(self.connection)
        self.register_again()

    def stay_registered(self) -> None:
        """Register again if this worker is missing from RQ's worker list: a Redis that restarted empty
        between two heartbeats has forgotten it, though this worker never saw the outage."""
        try:
            if not self.connection.sismember(self.redis_workers_keys, self.key):
                self.register_again()
        except REDIS_DOWN as exc:
            self.outage.down(exc)  # the next heartbeat tries again

    def register_again(self) -> None:
        """Write this worker's hash and registry entries again: a Redis that came back empty has lost
        them, and a worker nobody lists is one the reaper and the exporter cannot see."""
        with self.connection.pipeline() as pipe:
            pipe.hset(self.key, mapping=self.serialize())
            worker_registration.register(self, pipe)
            pipe.expire(self.key, self.worker_ttl + 60)
            pipe.execute()

    def maintain_heartbeats(self, job: Job, execution: Execution) -> None:
        # The work horse goes on through an outage; only the heartbeats are missed meanwhile.
        try:
            super().maintain_heartbeats(job, execution)
        except REDIS_DOWN as exc:
            self.outage.down(exc)
            return
        self.outage.up()
        self.stay_registered()

    def until_redis_answers(self, call: Callable[[], T]) -> T:
        """``call()``, waiting out every outage it meets (with backoff, logged once) and calling again."""
        while True:
            try:
                return call()
            except REDIS_DOWN as exc:
                self.outage.down(exc)
                self.wait_for_redis()

    def heartbeat(self, timeout: int | None = None, pipeline=None) -> None:
        # Called between jobs and first in every round of the dequeue loop: block here until Redis is
        # back, so the loop's own retries (and their log lines) do not start.
        if pipeline is not None:
            super().heartbeat(timeout, pipeline)
            return
        self.until_redis_answers(lambda: super(DraftlineWorker, self).heartbeat(timeout))
        self.outage.up()
        self.stay_registered()

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None):
        return self.until_redis_answers(lambda: super(DraftlineWorker, self).dequeue_job_and_maintain_ttl(
            timeout, max_idle_time))

    def check_for_suspension(self, burst: bool) -> None:
        self.until_redis_answers(lambda: super(DraftlineWorker, self).check_for_suspension(burst))

    def run_maintenance_tasks(self) -> None:
        try:
            super().run_maintenance_tasks()
        except REDIS_DOWN as exc:
            self.outage.down(exc)  # maintenance runs again at its next interval

    def teardown(self) -> None:
        try:
            super().teardown()
        except REDIS_DOWN as exc:
            log.warning("worker %s: could not record its death in redis: %s", self.name, exc)
            self.unsubscribe()  # RQ records the death first: the channel still has to be let go

    def unsubscribe(self) -> None:
        """Leave this worker's command channel without RQ's race: RQ sends UNSUBSCRIBE and only then tells the
        channel's thread to stop, joining it without a limit (redis-py 8's ``stop``). A thread that reads the
        reply first finds itself unsubscribed and waits out its 60 s poll for a new subscription, and the warm
        shutdown waits with it (rq/rq#1613, #2201; seen on a loaded CI machine). The thread is told first here,
        so the reply ends it, and the wait is bounded: a channel Redis cannot answer on is left to the exit."""
        thread, pubsub = self.pubsub_thread, self.pubsub
        if thread is None or pubsub is None:
            return
        log.info("worker %s: unsubscribing from channel %s", self.name, self.pubsub_channel_name)
        self.pubsub_thread = None
        thread.stop(timeout=0)  # clears its run flag; the zero timeout returns at once
        try:
            pubsub.unsubscribe()
        except REDIS_DOWN as exc:
            log.warning("worker %s: could not unsubscribe from its channel: %s", self.name, exc)
        thread.join(UNSUBSCRIBE_WAIT_S)
        if thread.is_alive():  # a daemon thread: it ends with the process
            log.warning("worker %s: its channel's thread did not end within %g s; exiting without it",
                        self.name, UNSUBSCRIBE_WAIT_S)
        # The thread closes the channel's connection as it ends; closing it under a live reader is what the
        # order above avoids.


def without_rq_reconnect_lines(record: logging.LogRecord) -> bool:
    """Drop RQ's "could not connect to Redis" line, repeated at every retry of its dequeue loop: the
    worker's RedisOutage logs an outage once when it starts and once when it ends."""
    return not str(record.msg).startswith("Worker %s: could not connect to Redis instance")


def job_function(job: Job) -> str | None:
    """The dotted name of the function ``job`` asks for; None when its data does not decode."""
    try:
        return job.func_name
    except DeserializationError:
        return None


def refuse_foreign(job: Job, queue: Queue) -> None:
    """Fail a job that names a function outside ``JOB_FUNCS`` for its queue, having run nothing: no work
    horse is forked and nothing is imported by the name the job gives."""
    allowed = ", ".join(sorted(JOB_FUNCS.get(queue.name, ()))) or "none"
    message = (f"{ForeignJob.__name__}: job {job.id} names {job_function(job)!r}, not a draftline job function of "
               f"queue {queue.name} ({allowed}); refused, nothing ran")
    with job.connection.pipeline() as pipe:
        pipe.lrem(queue.intermediate_queue_key, 0, job.id)
        record_job_failure(job, message, pipe)
        pipe.execute()
    log.error("%s", message)


def horse_loss(job: Job, ret_val: int | None) -> str | None:
    """How a work horse that ended without settling its job was lost, or None when its end is a failure
    of the job itself (a non-zero exit, or the worker's own kill of a horse past its timeout).

    A signal from outside (the OOM killer's SIGKILL) says nothing against the job. Neither does an exit
    status nobody can read any more: RQ's wait for the horse finds no child (``ret_val`` None) when the
    horse was reaped elsewhere, as seen under load after a SIGKILL of its process group."""
    if overran(job):
        return None
    if ret_val is None:
        return "gone, its exit status lost"
    if os.WIFSIGNALED(ret_val):
        return f"killed by {signal.Signals(os.WTERMSIG(ret_val)).name}"
    return None


def overran(job: Job) -> bool:
    """Whether the worker itself killed the horse for running past the job's timeout (RQ allows 60 s
    more): a hang, which is a failure of the job, unlike a kill from outside."""
    return overran_by(job) is not None


def worker_name(role: str, host: str, pid: int | str) -> str:
    """A worker's name in RQ: its role, its host (a container's id) and its process id."""
    return f"{role}-{host}-{pid}"


def registered_workers(conn: redis.Redis, role: str, host: str) -> list[str]:
    """The names of ``role``'s workers on ``host`` that Redis lists and still holds: a worker's hash lives
    until WORKER_TTL_S + 60 s after its last heartbeat, so a listed one is alive or just died."""
    prefix = Worker.redis_worker_namespace_prefix + worker_name(role, host, "")
    listed = sorted(key.decode() for key in conn.smembers(Worker.redis_workers_keys))
    return [key.removeprefix(Worker.redis_worker_namespace_prefix)
            for key in listed if key.startswith(prefix) and conn.exists(key)]


def run_worker(
    queue_names: Sequence[str],
    settings: CommonSettings,
    *,
    role: str,
    preload: Callable[[], None] | None = None,
    burst: bool = False,
    job_process: Literal["fork", "inline"] = "fork",
) -> None:
    """Serve ``queue_names`` until stopped, each job run as ``job_process`` says. ``preload`` runs once
    before the first job, so what it caches (a tokenizer, say) is shared by every job instead of loaded
    per job."""
    configure_logging(settings.log_level)
    conn = connect(settings.redis_url)
    # A worker that starts before Redis waits instead of crashing (compose starts them together).
    RedisOutage(f"{role} worker", settings.redis_url).wait(conn, max_wait_s=START_WAIT_S)
    verify_volume(settings.data, conn)  # refuse before loading anything: a wrong mount is a setup error
    if preload is not None:
        preload()
    tls_context()  # built once here, inherited by every job's forked process (runtime.retry.tls_context)
    preload_http()  # and httpx's lazily imported modules, which each job's process would import again
    name = worker_name(role, socket.gethostname(), os.getpid())
    worker = DraftlineWorker(
        [queue(n, conn) for n in queue_names],
        connection=conn,
        serializer=SERIALIZER,
        name=name,
        worker_ttl=WORKER_TTL_S,
        job_monitoring_interval=JOB_MONITORING_INTERVAL_S,
    )
    worker.data = settings.data
    worker.inline = job_process == "inline"
    logging.getLogger("rq.worker").addFilter(without_rq_reconnect_lines)  # RedisOutage says it once
    log.info("worker %s: serving %s from %s, jobs %s", name, ", ".join(queue_names), settings.data,
             "inline" if worker.inline else "in forked work horses")
    worker.work(burst=burst, logging_level=settings.log_level)
    if worker.refused is not None:
        raise worker.refused
