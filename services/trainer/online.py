"""Online training's feed: the trainer asks for each sample's hidden states in its own order, within the run's byte
budget, waits for each step's files, and deletes each file once the step that read it is done.

The plan (``online_plan.py``) fixes the samples and their lengths; each epoch's global batches are planned from
those lengths as offline (``sources.epoch_plan``: by length within a seeded shuffle window, the batch order
shuffled). The states are made again for every epoch, so extraction follows the trainer's order. A checkpoint's
position (epoch, batch) continues the same order after a resume, on any number of processes when
``global_batch_size`` is set.

Flow, on rank 0:

- **batches**: planned as offline, except that where the budget could not hold two of the largest batches' files
  beside the held-out ones, a global batch also holds no more padded tokens than half that room takes
  (``batch_token_cap``, recorded in the plan's facts): length grouping puts the longest files together.
- **window**: the samples of the next global batches in training order, as many as the budget holds beside the
  held-out files at their estimated sizes (each sample's tokens, known from the plan, times the bytes a token
  takes, fitted to the files landed so far: ``SizeModel``), and no more steps ahead than the measured rates call
  for: extraction's throughput (files landed per second while it had work) against the trainer's step time, with
  a margin of two. A file of a later sample is asked for only once every earlier one fits beside it, so it never
  takes an earlier one's room. Status shows the window (``ONLINE_WINDOW_*``).
- **ask**: the window's samples without a file are queued for extraction in training order, one job each (jobs
  are taken in the order they are queued); one asked less than ``ASK_AGAIN_S`` ago is not asked again, so a job
  lost with Redis is asked for again, and a queued one is not doubled (``runtime.sample_queue``'s deterministic
  job ids).
- **wait**: before a step every rank waits until each sample of the global batch has a verified file (its shard
  manifest names it, written after the file: ``ready``) or a failure record (skipped, named in the log, in every
  epoch after). While it waits, rank 0 keeps room in the budget for the files the batch still misses
  (``keep_room``); with the spool full, it deletes files of later samples no step has read, the farthest ahead
  first, until the spool is within its budget (``make_room``, counted as ``evicted``: a fallback where the size
  estimate fell short, not the steady state), and names the sample it waits for the run's ``online_head``, whose
  extraction may pass the budget, so the spool peaks at the budget plus one file.
- **release**: once a step is done (every rank has read its share), the files it read are deleted unless the
  window still holds them (the next epoch's early samples). No file waits for a checkpoint: a resume asks again
  for the samples of the steps after its checkpoint, whose replies are on the volume, and extraction is
  deterministic.

Every step's samples go into ``train_log.jsonl`` (``samples``, global ids), so each epoch's multiset is on the
volume, and a resume's log, cut back to its checkpoint, still holds each sample once per epoch.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rq.job import Job

from runtime.disk import BYTES_PER_TOKEN_ESTIMATE, HIDDEN_BYTES, _number, _s
from runtime.runstate import RunState
from runtime.sample_queue import enqueue_extract
from runtime.spool import (
    ONLINE_BATCH,
    ONLINE_EPOCH,
    ONLINE_EPOCH_SAMPLES,
    ONLINE_EPOCH_TRAINED,
    ONLINE_EVICTED,
    ONLINE_HEAD,
    ONLINE_LANDED,
    ONLINE_REFUSED_AT,
    ONLINE_RESERVE,
    ONLINE_STARTED_AT,
    ONLINE_TRAIN_S,
    ONLINE_WAIT_S,
    ONLINE_WINDOW_BYTES,
    ONLINE_WINDOW_FILES,
    ONLINE_WINDOW_LIMIT,
    ONLINE_WINDOW_STEPS,
    WindowLimit,
    add_seconds,
    present,
    release_many,
    resync,
    spool_bytes,
)
from services.trainer.online_plan import OnlinePlan, OnlinePlanError
from shared.errors import DraftlineError, HiddenStateFileError
from shared.jobs import extract_job_id
from shared.lifecycle import Stage
from shared.manifest import MANIFEST_NAME, ManifestEntry, check_quick, read_manifest

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often a waiting rank looks for its files
ASK_AGAIN_S = 60.0  # a sample asked for this long ago and still without a file is asked for again
# One sample a job: jobs are taken in the order they are queued, which is the trainer's, so the extractors work on
# the earliest samples asked for; a job of several would extract them in id order, and one of its samples held
# back by the budget could keep the sample the trainer waits for behind it.
ASK_BATCH = 1
LOST_CHECK_S = 5.0  # a sample asked for this long ago, still without a file, has its job looked for in Redis
REFUSED_RECENTLY_S = 2.0  # an extraction the budget refused this recently means the spool is full for real
MAX_AHEAD = 4096  # samples asked ahead at most, whatever the budget holds
KEEP_AGAIN_S = 5.0  # the room kept for a batch is written again this often (a Redis restarted empty lost it)
RATE_MARGIN = 2.0  # the window holds this many times the steps that extracting a batch takes at the measured rates
MIN_STEPS_AHEAD = 2  # and at least this many steps beyond that
SMOOTHING = 0.2  # weight of the newest measurement in the step time's and extraction rate's moving averages
REPORT_EVERY_S = 1.0


class GlobalBatchFailed(DraftlineError):
    """Every sample of a global batch failed extraction: the step has nothing to train on."""


class OnlineBudgetTooSmall(OnlinePlanError):
    """The budget cannot hold the held-out files and one global batch's files at once."""


def names_version(entry: ManifestEntry, mtime_ns: int) -> bool:
    """The entry is for the file version of modification time ``mtime_ns`` (by the time its writer recorded; an
    entry without one, by its wall-clock time: written after the file landed)."""
    return entry.mtime_ns == mtime_ns if entry.mtime_ns is not None else entry.at * 1e9 >= mtime_ns


@dataclass
class SizeModel:
    """A hidden-state file's bytes from its tokens, ``overhead + per_token x tokens`` fitted (least squares) to the
    files landed so far: the states grow with the tokens, the header and scales by a little. Before any file, the
    bytes per token the run recorded at submission, with no overhead."""

    count: int = 0
    tokens: float = 0.0
    nbytes: float = 0.0
    tokens_sq: float = 0.0
    tokens_bytes: float = 0.0
    prior_per_token: float = 0.0
    seen: set[int] = field(default_factory=set)

    def add(self, sample_id: int, tokens: int, nbytes: int) -> None:
        if sample_id in self.seen:
            return
        self.seen.add(sample_id)
        self.count += 1
        self.tokens += tokens
        self.nbytes += nbytes
        self.tokens_sq += tokens * tokens
        self.tokens_bytes += tokens * nbytes

    def fit(self) -> tuple[float, float] | None:
        """``(overhead, per_token)``; None while nothing is known."""
        if self.count == 0:
            return (0.0, self.prior_per_token) if self.prior_per_token > 0 else None
        spread = self.count * self.tokens_sq - self.tokens * self.tokens
        if self.count > 1 and spread > 0:
            per_token = (self.count * self.tokens_bytes - self.tokens * self.nbytes) / spread
            overhead = (self.nbytes - per_token * self.tokens) / self.count
            if per_token > 0 and overhead >= 0:
                return overhead, per_token
        return 0.0, self.nbytes / max(self.tokens, 1.0)

    def estimate(self, tokens: int) -> float | None:
        fitted = self.fit()
        return None if fitted is None else fitted[0] + fitted[1] * tokens

    @property
    def mean_bytes(self) -> float:
        return self.nbytes / self.count if self.count else 0.0


@dataclass
class Rates:
    """The trainer's step time and extraction's throughput, as moving averages of what each step measured."""

    step_s: float | None = None  # a step's time without waiting for files
    landed_per_s: float | None = None  # files landed per second while extraction had work waiting
    last_landed: int | None = None
    last_at: float | None = None

    def note_step(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else (1 - SMOOTHING) * self.step_s + SMOOTHING * seconds

    def note_landed(self, landed: int, busy: bool, now: float) -> None:
        """``landed``: the run's files landed so far; ``busy``: extraction had work waiting through the interval
        (otherwise the interval says how fast the trainer asked, not how fast extraction can go)."""
        if busy and self.last_landed is not None and self.last_at is not None and now - self.last_at > 0:
            rate = (landed - self.last_landed) / (now - self.last_at)
            self.landed_per_s = rate if self.landed_per_s is None else (1 - SMOOTHING) * self.landed_per_s + SMOOTHING * rate
        self.last_landed, self.last_at = landed, now

    def steps_ahead(self, span: int) -> int | None:
        """Steps of files the window needs ahead so the trainer never waits; None where the rates are not measured
        or extraction is the slower side (then only the budget bounds the window)."""
        if self.step_s is None or not self.landed_per_s:
            return None
        batch_s = span / self.landed_per_s  # extracting one global batch's files
        if batch_s >= self.step_s:
            return None
        return math.ceil(RATE_MARGIN * batch_s / self.step_s) + MIN_STEPS_AHEAD


@dataclass(frozen=True)
class Window:
    """The samples asked for ahead, in training order, and what bounds them."""

    ids: list[int]
    steps: int  # global batches it reaches into (the one waited for first)
    nbytes: int  # their files' estimated bytes
    limit: str  # WindowLimit

    @property
    def members(self) -> set[int]:
        return set(self.ids)


@dataclass
class Feed:
    """One rank's view of the spool; rank 0 also asks for states, releases files and reports."""

    state: RunState
    plan: OnlinePlan
    plans: list[list[list[int]]]  # each epoch's global batches, indices into plan.train_ids
    rank: int
    budget: int
    span: int  # samples of a global batch (global_batch_size, or batch_size x processes)
    extract_batch: int = ASK_BATCH
    asked: dict[int, float] = field(default_factory=dict)  # sample id -> when it was last asked for
    failed: set[int] = field(default_factory=set)  # failed extraction: skipped in every epoch
    evicted: set[int] = field(default_factory=set)  # let go unread for a batch waited for: not asked ahead till it is whole
    loading: set[int] = field(default_factory=set)  # files a loader reads now: never evicted
    batch_too_big: bool = False  # warned that a batch's files exceed the budget
    kept_for: list[int] | None = None  # the samples the budget keeps room for (``keep_room``), as last set
    kept_at: float = 0.0
    unready_since: dict[int, float] = field(default_factory=dict)  # a file waited for, on the volume but not ready
    manifests: dict[Path, dict[int, ManifestEntry]] = field(default_factory=dict)
    sizes: SizeModel = field(default_factory=SizeModel)
    rates: Rates = field(default_factory=Rates)
    window: Window = field(default_factory=lambda: Window([], 0, 0, WindowLimit.UNMEASURED))
    held_bytes: int = 0  # the held-out validation files' bytes, kept beside the spool's others
    waited_s: float = 0.0  # waiting not yet added to the run's meta
    last_report: float = field(default_factory=time.monotonic)
    step_started: float | None = None  # when the step being trained stopped waiting for its files
    tokens: dict[int, int] = field(init=False)  # each training sample's file length, from the plan
    # The loop's thread does this bookkeeping between steps with nothing queued on the GPU, so a file is looked at
    # in full once (``ready``) and by one stat after that (bench/bench_feed_step.py measures what that saves).
    verified: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # sample id -> (mtime, size, inode) found ready
    seen: set[int] = field(default_factory=set)  # samples asked for whose file was on the volume at a look
    hidden_paths: dict[int, Path] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tokens = dict(zip(self.plan.train_ids, self.plan.tokens))

    @property
    def paths(self):
        return self.state.paths

    def hidden(self, sample_id: int) -> Path:
        """The sample's hidden-state path (made once: a path is built from five parts, and a step looks at hundreds)."""
        path = self.hidden_paths.get(sample_id)
        if path is None:
            path = self.hidden_paths[sample_id] = self.paths.hidden(sample_id)
        return path

    def on_volume(self, sample_id: int) -> bool:
        """The sample's file was there at a look since the feed last let it go (stat'ed until it is): for the rates'
        look at whether extraction has work, where a file deleted behind the feed's back costs an estimate, not a
        wait."""
        if sample_id in self.seen:
            return True
        if self.hidden(sample_id).is_file():
            self.seen.add(sample_id)
            return True
        return False

    def let_go(self, *sample_ids: int, counter: str | None = None) -> int:
        """Delete the samples' files (``runtime.spool.release_many``) and forget what this feed knew of them; the
        bytes freed."""
        freed = release_many(self.state, sample_ids, **({"counter": counter} if counter else {}))
        for sample_id in sample_ids:
            self.asked.pop(sample_id, None)  # gone from the volume: asked for afresh when training nears it again
            self.verified.pop(sample_id, None)
            self.seen.discard(sample_id)
            self.hidden_paths.pop(sample_id, None)  # what the feed holds of files stays the spool's few
        return freed

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # ---- where the trainer stands and what comes next ----------------------------------------

    def steps_from(self, epoch: int, index: int) -> Iterator[tuple[int, int]]:
        """Every (epoch, batch) from batch ``index`` of ``epoch`` on, in training order."""
        for e in range(epoch, len(self.plans)):
            for i in range(index if e == epoch else 0, len(self.plans[e])):
                yield e, i

    def following(self, epoch: int, index: int) -> tuple[int, int]:
        return (epoch, index + 1) if index + 1 < len(self.plans[epoch]) else (epoch + 1, 0)

    def batch_ids(self, epoch: int, index: int) -> list[int]:
        return [self.plan.train_ids[i] for i in self.plans[epoch][index]]

    def upcoming(self, epoch: int, index: int, limit: int) -> list[int]:
        """The next ``limit`` sample ids the trainer reads from batch ``index`` of ``epoch`` on, in order."""
        ids: list[int] = []
        for e, i in self.steps_from(epoch, index):
            ids += [s for s in self.batch_ids(e, i) if s not in self.failed]
            if len(ids) >= limit:
                return ids[:limit]
        return ids

    def estimate(self, sample_id: int) -> float:
        """A sample's file's bytes, measured where it landed before, else estimated from its tokens."""
        known = self.sizes.estimate(self.tokens.get(sample_id, 0))
        return known if known is not None else 0.0

    def plan_window(self, epoch: int, index: int) -> Window:
        """The window from batch ``index`` of ``epoch`` on (see the module doc): whole batches' samples while they
        fit the budget beside the held-out files, the batch waited for always, and no more steps than the rates
        call for."""
        room = self.budget - self.held_bytes
        wanted = self.rates.steps_ahead(self.span)
        if self.sizes.fit() is None:  # nothing measured or estimated: one batch at a time
            room, wanted = 0, 1
        ids: list[int] = []
        chosen: set[int] = set()
        nbytes, steps, limit = 0.0, 0, WindowLimit.END
        for e, i in self.steps_from(epoch, index):
            if len(ids) >= MAX_AHEAD:
                limit = WindowLimit.BUDGET
                break
            if wanted is not None and steps >= wanted:
                limit = WindowLimit.RATES if self.sizes.fit() is not None else WindowLimit.UNMEASURED
                break
            fresh = [s for s in self.batch_ids(e, i) if s not in self.failed and s not in chosen]
            extra = sum(self.estimate(s) for s in fresh)
            if steps > 0 and nbytes + extra > room:
                # The part of this batch that fits: the extractors start on it while the trainer reads the rest.
                for sample_id in fresh:
                    if nbytes + self.estimate(sample_id) > room:
                        break
                    nbytes += self.estimate(sample_id)
                    ids.append(sample_id)
                limit = WindowLimit.BUDGET
                break
            ids += fresh
            chosen.update(fresh)
            nbytes += extra
            steps += 1
        return Window(ids, steps, int(nbytes), limit)

    # ---- on rank 0: asking, releasing, reporting ----------------------------------------------

    def start(self) -> None:
        """On (re)starting: the spool's counts made equal to the files on the volume, and the size model primed."""
        if not self.leader:
            return
        self._measure(resync(self.state, [*self.plan.train_ids, *self.plan.validation_ids]))
        meta = self.state.meta()
        self.sizes.prior_per_token = _number(meta, BYTES_PER_TOKEN_ESTIMATE)
        self.state.set_meta(**({} if ONLINE_STARTED_AT in meta else {ONLINE_STARTED_AT: time.time()}),
                            **{ONLINE_EPOCH_SAMPLES: len(self.plan.train_ids), ONLINE_HEAD: "", ONLINE_BATCH: "",
                               ONLINE_RESERVE: 0})

    def _measure(self, found: dict[int, tuple[int, int]]) -> None:
        for sample_id, (nbytes, tokens) in found.items():
            self.sizes.add(sample_id, tokens, nbytes)
        self.held_bytes = sum(b for i, (b, _) in found.items() if i in self.plan.validation_ids)

    def settle(self, epoch: int, index: int) -> None:
        """Once the session knows where it resumes: release every file outside the window (read by the session
        that was killed, or asked for by it far ahead), and ask for the window."""
        if not self.leader:
            return
        self.check_budget()
        self.window = self.plan_window(epoch, index)
        keep = self.window.members | set(self.plan.validation_ids)
        gone = [i for i in present(self.state, self.plan.train_ids) if i not in keep]
        self.let_go(*gone)
        if gone:
            log.info("run %s: released %d files outside the window at epoch %d, batch %d", self.state.run,
                     len(gone), epoch, index)
        self._ask_window()

    def batch_token_cap(self, uncapped: list[list[list[int]]], lengths: list[int]) -> int | None:
        """The most padded tokens a global batch may hold so that the budget holds two batches' files beside the
        held-out ones (one trained, the next extracted meanwhile), or None where every batch of ``uncapped`` (the
        plan as offline batches it) already fits: then online batches are offline's. Batches grouped by length put
        the longest files together, and a tight budget could not hold the longest batch at all."""
        if self.sizes.fit() is None:
            return None
        room = (self.budget - self.held_bytes) / 2
        ids = self.plan.train_ids
        largest = max((sum(self.estimate(ids[i]) for i in batch) for epoch in uncapped for batch in epoch),
                      default=0.0)
        if largest <= room:
            return None
        # A batch's bytes are at most its padded tokens times the most bytes any sample takes a trained token.
        per_token = max(self.estimate(ids[i]) / max(1, lengths[i]) for i in range(len(ids)))
        return max(1, int(room // per_token))

    def check_budget(self) -> None:
        """The budget must hold the held-out files beside the largest global batch's files, at the sizes estimated:
        a smaller one could never train that batch, so it fails now, by name, with the budget that would do."""
        if self.sizes.fit() is None:
            return
        largest = max((sum(self.estimate(s) for s in self.batch_ids(e, i))
                       for e in range(len(self.plans)) for i in range(len(self.plans[e]))), default=0.0)
        need = int(self.held_bytes + largest)
        if need > self.budget:
            raise OnlineBudgetTooSmall(
                f"online.budget_bytes {self.budget:,} cannot hold the {len(self.plan.validation_ids)} held-out files "
                f"({self.held_bytes:,} bytes) beside the largest global batch's files (about {int(largest):,} bytes at "
                f"the sizes measured): at least {need:,} bytes are needed, and a few batches more keep the trainer "
                "from waiting; raise it, or lower train.batch_size, train.max_tokens or train.validation_files")

    def ask(self, sample_ids: list[int], *, lost: bool = False, ahead: bool = False) -> None:
        """Queue the extraction of those of ``sample_ids`` without a file that were not asked for lately, and,
        with ``lost``, of those whose job Redis no longer holds (a Redis restarted empty); ``ahead`` (samples
        asked for before they are waited for) leaves out those deleted unread to make room (``make_room``)."""
        now = time.monotonic()
        wanted = [i for i in sample_ids
                  if (now - self.asked.get(i, -ASK_AGAIN_S) >= ASK_AGAIN_S
                      or (lost and now - self.asked[i] >= LOST_CHECK_S and self._job_lost(i)))
                  and i not in self.failed and not (ahead and i in self.evicted)
                  and not self.hidden(i).is_file()]  # a stat, not ``on_volume``: a file gone is asked for again
        for first in range(0, len(wanted), self.extract_batch):
            chunk = wanted[first:first + self.extract_batch]
            enqueue_extract(self.state.conn, self.state.run, chunk, batch=self.extract_batch)
            for sample_id in chunk:
                self.asked[sample_id] = now

    def _ask_window(self) -> None:
        self.ask(self.window.ids, ahead=True)
        self.state.set_meta(**{ONLINE_WINDOW_FILES: len(self.window.ids), ONLINE_WINDOW_STEPS: self.window.steps,
                               ONLINE_WINDOW_BYTES: self.window.nbytes, ONLINE_WINDOW_LIMIT: self.window.limit})

    def after_step(self, epoch: int, index: int) -> None:
        """The step that read batch ``index`` of ``epoch`` is done on every rank: its files go unless the window from
        the next batch on holds them, and the window's new samples are asked for."""
        now = time.monotonic()
        if self.step_started is not None:
            self.rates.note_step(now - self.step_started)
        if not self.leader:
            return
        landed = int(_number({ONLINE_LANDED: _s(self.state.conn.hget(self.state.keys.meta, ONLINE_LANDED))},
                             ONLINE_LANDED))
        # Extraction had work waiting when a sample asked for is still without its file (the window's tail first:
        # the latest asked are the likeliest to be missing, so the look usually ends at once).
        busy = any(i in self.asked and not self.on_volume(i) for i in reversed(self.window.ids))
        self.rates.note_landed(landed, busy=busy, now=now)
        self.window = self.plan_window(*self.following(epoch, index))
        keep = self.window.members
        self.let_go(*(i for i in self.batch_ids(epoch, index) if i not in keep and i not in self.failed))
        self._ask_window()

    def clear_orphans(self, missing: list[int]) -> None:
        """Delete the file of a sample waited for that has stayed unready for ``LOST_CHECK_S`` with no extraction
        job left in Redis (its extractor lost Redis, or was killed, between the file's rename and its manifest
        entry): nothing will make it ready, and while it is there it is not asked for again."""
        now = time.monotonic()
        for sample_id in missing:
            if not self.hidden(sample_id).is_file():
                self.unready_since.pop(sample_id, None)
                continue
            since = self.unready_since.setdefault(sample_id, now)
            if now - since >= LOST_CHECK_S and self._job_lost(sample_id):
                self.let_go(sample_id)
                self.unready_since.pop(sample_id, None)
                log.warning("run %s: sample %d's file has no manifest entry naming it and no extraction holds it: "
                            "deleted, to be extracted again", self.state.run, sample_id)

    def _job_lost(self, sample_id: int) -> bool:
        job_id = extract_job_id(self.state.run, sample_id)
        return not Job.exists(job_id, connection=self.state.conn)

    def wait_ready(self, sample_ids: list[int]) -> None:
        """Wait until each of ``sample_ids`` has its file or failed (the held-out files)."""
        started = time.monotonic()
        while missing := [i for i in sample_ids if not self.ready(i) and not self._failed(i)]:
            if self.leader:
                self.tend(missing, set(sample_ids), 0, 0)
            time.sleep(POLL_S)
        if self.leader:
            self.keep_room([])
            self.waited_s += time.monotonic() - started
            self._measure(present(self.state, self.plan.validation_ids))

    def tend(self, missing: list[int], keep: set[int], epoch: int, index: int) -> None:
        """One look, on rank 0, while it waits for ``missing`` (of ``keep``, the samples waited for at ``epoch``'s
        batch ``index``): room kept for them; with the spool full, later unread files deleted to bring it within
        budget and the first missing named the one that may pass it; files no job will make ready cleared; and the
        missing asked for."""
        if not missing:
            return  # the batch settled between the caller's two looks: nothing is waited for
        self.keep_room(missing)
        head = self.spool_full()
        if head:
            self.make_room(keep, epoch, index)
        self.state.set_meta(**{ONLINE_HEAD: missing[0] if head else ""})
        self.clear_orphans(missing)
        self.ask(missing, lost=True)

    def keep_room(self, missing: list[int]) -> None:
        """Keep room in the budget for ``missing`` (the samples of the batch read next that have no file yet), at
        their estimated sizes: claims of other samples must leave it free (``runtime.disk_claims``)."""
        if missing == self.kept_for and time.monotonic() - self.kept_at < KEEP_AGAIN_S:
            return
        self.kept_for, self.kept_at = list(missing), time.monotonic()
        self.state.set_meta(**{ONLINE_BATCH: ",".join(str(i) for i in missing),
                               ONLINE_RESERVE: int(sum(self.estimate(i) for i in missing))})

    def make_room(self, keep: set[int], epoch: int, index: int) -> None:
        """Before the sample waited for may pass the budget: delete files of later samples that no step has read
        (not in ``keep``, the batch waited for, nor being loaded), the farthest ahead first, until the spool is
        within its budget, so that sample passes it by one file at most. When only ``keep``'s files are left and
        they exceed the budget, the batch passes it anyway (said once)."""
        room = self.budget - spool_bytes(self.state.conn, self.state.run)
        if room >= 0:
            return
        let_go = []
        # Each sample by when training next reads it (its first place ahead; the next epoch reads it again later).
        for sample_id in reversed(list(dict.fromkeys(self.upcoming(epoch, index, MAX_AHEAD)))):
            if room >= 0:
                break
            if sample_id in keep or sample_id in self.loading or not self.ready(sample_id):
                continue  # a file not yet counted by its extractor is not the trainer's to delete
            room += self.let_go(sample_id, counter=ONLINE_EVICTED)
            self.evicted.add(sample_id)
            let_go.append(sample_id)
        if let_go:
            log.info("run %s: deleted %d unread files of later samples (%s) to make room for epoch %d's batch %d",
                     self.state.run, len(let_go), let_go, epoch, index)
        if room < 0 and not self.batch_too_big:
            self.batch_too_big = True
            log.warning("run %s: the files of epoch %d's batch %d and the held-out ones exceed online.budget_bytes %d: "
                        "the batch passes the budget (raise it, or lower train.batch_size)", self.state.run, epoch,
                        index, self.budget)

    def spool_full(self) -> bool:
        """Another file of the mean size would not fit the budget, or an extraction was refused by it lately."""
        meta = self.state.conn.hmget(self.state.keys.meta, [HIDDEN_BYTES, ONLINE_REFUSED_AT])
        spool, refused = (float(_s(v) or 0) for v in meta)
        return spool + self.sizes.mean_bytes > self.budget or time.time() - refused < REFUSED_RECENTLY_S

    def report(self, epoch: int, trained_in_epoch: int, *, force: bool = False) -> None:
        """The trainer's time, waits and epoch progress into the run's meta (at most once a second)."""
        now = time.monotonic()
        if not self.leader or (not force and now - self.last_report < REPORT_EVERY_S):
            return
        add_seconds(self.state.conn, self.state.run, ONLINE_TRAIN_S, now - self.last_report)
        add_seconds(self.state.conn, self.state.run, ONLINE_WAIT_S, self.waited_s)
        self.state.set_meta(**{ONLINE_EPOCH: epoch, ONLINE_EPOCH_TRAINED: trained_in_epoch})
        self.waited_s, self.last_report = 0.0, now

    # ---- on every rank: waiting for a batch -------------------------------------------------

    def ready(self, sample_id: int) -> bool:
        """The sample's file is on the volume, its shard's manifest names this version of it (the extractor appends
        the entry, with the file's modification time, only after verifying the file: ``names_version``), and the
        extractor has counted it (its done bit, set last). A version found ready once is known by its stat after."""
        path = self.hidden(sample_id)
        try:
            found = path.stat()
        except FileNotFoundError:
            return False
        mtime, version = found.st_mtime_ns, (found.st_mtime_ns, found.st_size, found.st_ino)
        if self.verified.get(sample_id) == version:
            return True
        shard = path.parent / MANIFEST_NAME
        entry = self.manifests.get(shard, {}).get(sample_id)
        if entry is None or not names_version(entry, mtime):
            self.manifests[shard] = read_manifest(shard)
            entry = self.manifests[shard].get(sample_id)
        if entry is None or not names_version(entry, mtime):
            return False
        try:
            check_quick(path, entry)
        except HiddenStateFileError:
            return False
        # Counted too: a file released before its extractor counted it would be counted after it is gone.
        if not self.state.is_done(Stage.EXTRACT, sample_id):
            return False
        self.sizes.add(sample_id, entry.num_tokens, entry.bytes)
        self.verified[sample_id] = version
        return True

    def _failed(self, sample_id: int) -> bool:
        if sample_id in self.failed:
            return True
        if self.paths.failure(Stage.EXTRACT, sample_id).is_file():
            self.failed.add(sample_id)
            log.warning("run %s: sample %d failed extraction (failures/extract): it trains in no epoch",
                        self.state.run, sample_id)
            return True
        return False

    def settled(self, epoch: int, index: int) -> list[int] | None:
        """The batch to train as indices into the plan's training ids, once every sample of it has its file or
        failed (every rank then trains the same samples); None while one is missing."""
        if any(not self.ready(i) and not self._failed(i) for i in self.batch_ids(epoch, index)):
            return None
        batch = [i for i in self.plans[epoch][index] if self.plan.train_ids[i] not in self.failed]
        if not batch:
            raise GlobalBatchFailed(f"every sample of epoch {epoch}'s batch {index} "
                                    f"({self.batch_ids(epoch, index)}) failed extraction")
        return batch

    def wait_for(self, epoch: int, index: int, interrupt: Callable[[], None] = lambda: None) -> list[int]:
        """Wait until every sample of the global batch has its file or failed; returns ``settled``'s batch. Rank 0
        tends the spool meanwhile; ``interrupt`` is called at every look (a stop request's check)."""
        started = time.monotonic()
        while (batch := self.settled(epoch, index)) is None:
            interrupt()
            if self.leader:
                ids = self.batch_ids(epoch, index)
                self.tend([i for i in ids if not self.ready(i) and not self._failed(i)], set(ids), epoch, index)
            time.sleep(POLL_S)
        self.evicted.clear()  # the batch is whole: what made room for it is asked for again as training nears it
        now = time.monotonic()
        self.step_started = now
        if self.leader:
            self.waited_s += now - started
            if now - started > POLL_S:
                self.state.set_meta(**{ONLINE_HEAD: ""})
            # The next step's files get the room as soon as this one's are in: they are the next to be read.
            nxt = self.following(epoch, index)
            nxt_ids = self.batch_ids(*nxt) if nxt[0] < len(self.plans) else []
            self.keep_room([i for i in nxt_ids if not self.ready(i) and not self._failed(i)])
        return batch
