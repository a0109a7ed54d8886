"""Online training: the trainer asks for each sample's hidden states in its own order, within the run's byte
budget, trains on them as they land, and deletes them once a checkpoint holds every step that read them.

The plan (``online_plan.json``, written once by rank 0 when training first starts, read by every rank and every
resume) fixes the samples: those with a reply when generation settled, less the ``train.validation_files`` held
out (picked by the same hash of the sample id as offline, and kept on the volume for the run's life).

Order: each epoch is a seeded permutation of the training samples (``batching.epoch_order``, the run's seed and the
epoch), cut into global batches of ``global_batch_size`` or ``batch_size`` x processes. The whole epoch is the
shuffle window: the states are made again for every epoch, so extraction follows the order instead of the order
following what happens to be on disk. A checkpoint's position (epoch, batch) therefore continues the same order
after a resume, on any number of processes when ``global_batch_size`` is set.

Flow, on rank 0:

- **ask**: the samples from the current position on, as many as the budget holds at the files' measured mean size
  (one global batch before any is measured), are queued for extraction in order; one asked less than
  ``ASK_AGAIN_S`` ago is not asked again, so a job lost with Redis is asked for again, and a queued one is not
  doubled (``runtime.sample_queue``'s deterministic job ids).
- **wait**: before a step every rank waits until each sample of the global batch has a verified file (its
  shard manifest names it, written after the file: ``ready``) or a failure record (skipped, named in the log,
  in every epoch after). Rank 0 keeps room in the budget for the files the batch still misses, and for the next
  batch's once this one is whole (``keep_room``): extractions of later samples must leave it free, so a job
  deferred to the back of the queue cannot lose its place to files asked for after it. While the spool is full and
  holds no file the trainer has read, the sample it waits for
  becomes the run's ``online_head``, whose extraction is granted past the budget, so a spool filled with later
  samples cannot keep the trainer waiting for an earlier one. Before naming it, rank 0 deletes files of later
  samples that no step has read, the farthest ahead first, until the spool is within its budget again
  (``make_room``; they are asked for again once the batch is whole): the spool then peaks at the budget plus one
  file, as long as a global batch's files fit the budget.
- **release**: after each checkpoint, the files read since the one before are deleted (``runtime.spool.release``)
  unless the next samples asked for include them again (the next epoch's early samples). A trainer waiting while
  the spool is full of files it has read checkpoints at once and releases them first: the budget never deadlocks
  training, but a budget that holds fewer files than ``save_every`` steps read makes checkpoints that often.

Every step's samples go into ``train_log.jsonl`` (``samples``, global ids), so each epoch's multiset is on the
volume, and a resume's log, cut back to its checkpoint, still holds each sample once per epoch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from runtime.runstate import RunState
from runtime.space import write_with_space
from runtime.sample_queue import enqueue_extract
from rq.job import Job

from runtime.disk import HIDDEN_BYTES, _s
from runtime.spool import (
    ONLINE_BATCH,
    ONLINE_EPOCH,
    ONLINE_EPOCH_SAMPLES,
    ONLINE_EPOCH_TRAINED,
    ONLINE_EVICTED,
    ONLINE_HEAD,
    ONLINE_REFUSED_AT,
    ONLINE_RESERVE,
    ONLINE_STARTED_AT,
    ONLINE_TRAIN_S,
    ONLINE_WAIT_S,
    add_seconds,
    present,
    release,
    resync,
    spool_bytes,
)
from services.trainer.batching import epoch_order, fixed_batches
from services.trainer.validation import validation_split
from shared.atomic import atomic_write_json, read_json
from shared.errors import DraftlineError, HiddenStateFileError
from shared.jobs import extract_job_id
from shared.layout import RunPaths
from shared.lifecycle import Stage
from shared.manifest import MANIFEST_NAME, ManifestEntry, check_quick, read_manifest
from shared.runspec import RunSpec, TrainConfig

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
PLAN_WAIT_S = 300.0  # how long a rank other than 0 waits for rank 0's plan


class OnlinePlanError(DraftlineError):
    """The online run has no samples to train on, or its plan on the volume cannot be read."""


class GlobalBatchFailed(DraftlineError):
    """Every sample of a global batch failed extraction: the step has nothing to train on."""


@dataclass(frozen=True)
class OnlinePlan:
    train_ids: list[int]
    validation_ids: list[int]

    def to_json(self) -> dict:
        return {"train_ids": self.train_ids, "validation_ids": self.validation_ids}


def make_plan(paths: RunPaths, spec: RunSpec) -> OnlinePlan:
    """The samples whose reply is on the volume (generation has settled), less those held out for validation."""
    with_reply = [(i, paths.generated(i)) for i in range(spec.train_ids)
                  if paths.generated(i).is_file() and not paths.failure(Stage.EXTRACT, i).is_file()]
    if not with_reply:
        raise OnlinePlanError(f"run {spec.name}: no sample has a reply to extract and train on")
    trained, held = validation_split(with_reply, spec.train.validation_files)
    ids = {path: i for i, path in with_reply}
    return OnlinePlan(sorted(ids[p] for p in trained), sorted(ids[p] for p in held))


def load_plan(paths: RunPaths, spec: RunSpec, rank: int) -> OnlinePlan:
    """Rank 0 reads the plan, or makes and writes it on the first start; the other ranks wait for it."""
    deadline = time.monotonic() + PLAN_WAIT_S
    while not paths.online_plan.is_file():
        if rank == 0:
            plan = make_plan(paths, spec)
            paths.online_plan.parent.mkdir(parents=True, exist_ok=True)
            write_with_space(lambda: atomic_write_json(paths.online_plan, plan.to_json()), "the online plan", paths.data)
            log.info("run %s: online plan: %d samples to train, %d held out for validation", spec.name,
                     len(plan.train_ids), len(plan.validation_ids))
            return plan
        if time.monotonic() > deadline:
            raise OnlinePlanError(f"{paths.online_plan}: rank 0 wrote no plan within {PLAN_WAIT_S:.0f}s")
        time.sleep(POLL_S)
    try:
        raw = read_json(paths.online_plan)
        return OnlinePlan([int(i) for i in raw["train_ids"]], [int(i) for i in raw["validation_ids"]])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise OnlinePlanError(f"{paths.online_plan}: unreadable ({exc})") from None


def names_version(entry: ManifestEntry, mtime_ns: int) -> bool:
    """The entry is for the file version of modification time ``mtime_ns`` (by the time its writer recorded; an
    entry without one, by its wall-clock time: written after the file landed)."""
    return entry.mtime_ns == mtime_ns if entry.mtime_ns is not None else entry.at * 1e9 >= mtime_ns


def global_span(cfg: TrainConfig, world: int) -> int:
    return cfg.global_batch_size if cfg.global_batch_size is not None else cfg.batch_size * world


def online_epoch_plan(cfg: TrainConfig, samples: int, epoch: int, world: int) -> list[list[int]]:
    """The epoch's global batches, as indices into the plan's training ids: a seeded shuffle, cut in order."""
    return fixed_batches(epoch_order(samples, cfg.seed, epoch), global_span(cfg, world))


@dataclass
class Feed:
    """One rank's view of the spool; rank 0 also asks for states, releases files and reports."""

    state: RunState
    plan: OnlinePlan
    plans: list[list[list[int]]]  # each epoch's global batches, indices into plan.train_ids
    rank: int
    budget: int
    extract_batch: int = ASK_BATCH
    asked: dict[int, float] = field(default_factory=dict)  # sample id -> when it was last asked for
    unreleased: set[int] = field(default_factory=set)  # read since the last checkpoint
    failed: set[int] = field(default_factory=set)  # failed extraction: skipped in every epoch
    evicted: set[int] = field(default_factory=set)  # let go unread for a batch waited for: not asked ahead till it is whole
    batch_too_big: bool = False  # warned that a batch's files exceed the budget
    kept_for: list[int] | None = None  # the samples the budget keeps room for (``keep_room``), as last set
    kept_at: float = 0.0
    unready_since: dict[int, float] = field(default_factory=dict)  # a file waited for, on the volume but not ready
    manifests: dict[Path, dict[int, ManifestEntry]] = field(default_factory=dict)
    batches: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (epoch, index) -> sample ids trained
    sizes: dict[int, int] = field(default_factory=dict)  # bytes of each sample's file, as last seen ready
    mean_bytes: float = 0.0  # a file's measured mean size
    held_bytes: int = 0  # the held-out validation files' bytes, kept beside the spool's others
    last_ask: float = 0.0
    waited_s: float = 0.0  # waiting not yet added to the run's meta
    last_report: float = field(default_factory=time.monotonic)

    @property
    def paths(self) -> RunPaths:
        return self.state.paths

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # ---- where the trainer stands and what comes next ----------------------------------------

    def upcoming(self, epoch: int, index: int, limit: int) -> list[int]:
        """The next ``limit`` sample ids the trainer reads from batch ``index`` of ``epoch`` on, in order."""
        ids: list[int] = []
        for e in range(epoch, len(self.plans)):
            for batch in self.plans[e][index if e == epoch else 0:]:
                ids += [self.plan.train_ids[i] for i in batch if self.plan.train_ids[i] not in self.failed]
                if len(ids) >= limit:
                    return ids[:limit]
        return ids

    def ahead(self, span: int) -> int:
        """How many samples to ask for ahead: what the budget holds beside the held-out files, at the mean size
        measured so far (one global batch before anything is measured), never fewer than one global batch."""
        if self.mean_bytes <= 0:
            return span
        return max(span, min(MAX_AHEAD, int((self.budget - self.held_bytes) // self.mean_bytes)))

    # ---- on rank 0: asking, releasing, reporting ----------------------------------------------

    def start(self) -> None:
        """On (re)starting: the spool's counts made equal to the files on the volume."""
        if not self.leader:
            return
        self._measure(resync(self.state, [*self.plan.train_ids, *self.plan.validation_ids]))
        meta = self.state.meta()
        self.state.set_meta(**({} if ONLINE_STARTED_AT in meta else {ONLINE_STARTED_AT: time.time()}),
                            **{ONLINE_EPOCH_SAMPLES: len(self.plan.train_ids), ONLINE_HEAD: "", ONLINE_BATCH: "",
                               ONLINE_RESERVE: 0})

    def settle(self, epoch: int, index: int, span: int) -> None:
        """Once the session knows where it resumes: release every file no step ahead reads (read before the
        checkpoint it resumes from, by the session that was killed), and ask for what comes next."""
        if not self.leader:
            return
        keep = set(self.upcoming(epoch, index, self.ahead(span))) | set(self.plan.validation_ids)
        gone = [i for i in present(self.state, self.plan.train_ids) if i not in keep]
        for sample_id in gone:
            release(self.state, sample_id)
            self.asked.pop(sample_id, None)
        if gone:
            log.info("run %s: released %d files read before the checkpoint at epoch %d, batch %d", self.state.run,
                     len(gone), epoch, index)
        self.ask_ahead(epoch, index, span)

    def _measure(self, found: dict[int, tuple[int, int]]) -> None:
        self.sizes.update({i: b for i, (b, _) in found.items()})
        if self.sizes:
            self.mean_bytes = sum(self.sizes.values()) / len(self.sizes)
        self.held_bytes = sum(b for i, (b, _) in found.items() if i in self.plan.validation_ids)

    def ask(self, sample_ids: list[int], *, lost: bool = False, ahead: bool = False) -> None:
        """Queue the extraction of those of ``sample_ids`` without a file that were not asked for lately, and,
        with ``lost``, of those whose job Redis no longer holds (a Redis restarted empty); ``ahead`` (samples
        asked for before they are waited for) leaves out those deleted unread to make room (``make_room``)."""
        now = time.monotonic()
        wanted = [i for i in sample_ids
                  if (now - self.asked.get(i, -ASK_AGAIN_S) >= ASK_AGAIN_S
                      or (lost and now - self.asked[i] >= LOST_CHECK_S and self._job_lost(i)))
                  and not self.paths.hidden(i).is_file() and i not in self.failed
                  and not (ahead and i in self.evicted)]
        for first in range(0, len(wanted), self.extract_batch):
            chunk = wanted[first:first + self.extract_batch]
            enqueue_extract(self.state.conn, self.state.run, chunk, batch=self.extract_batch)
            for sample_id in chunk:
                self.asked[sample_id] = now

    def clear_orphans(self, missing: list[int]) -> None:
        """Delete the file of a sample waited for that has stayed unready for ``LOST_CHECK_S`` with no extraction
        job left in Redis (its extractor lost Redis, or was killed, between the file's rename and its manifest
        entry): nothing will make it ready, and while it is there it is not asked for again."""
        now = time.monotonic()
        for sample_id in missing:
            if not self.paths.hidden(sample_id).is_file():
                self.unready_since.pop(sample_id, None)
                continue
            since = self.unready_since.setdefault(sample_id, now)
            if now - since >= LOST_CHECK_S and self._job_lost(sample_id):
                release(self.state, sample_id)
                self.asked.pop(sample_id, None)
                self.unready_since.pop(sample_id, None)
                log.warning("run %s: sample %d's file has no manifest entry naming it and no extraction holds it: "
                            "deleted, to be extracted again", self.state.run, sample_id)

    def _job_lost(self, sample_id: int) -> bool:
        job_id = extract_job_id(self.state.run, sample_id)
        return not Job.exists(job_id, connection=self.state.conn)

    def ask_ahead(self, epoch: int, index: int, span: int) -> None:
        """Ask for what the budget holds from here on (at most once a second: it looks at every file ahead)."""
        if self.leader and time.monotonic() - self.last_ask >= 1.0:
            self.last_ask = time.monotonic()
            self.ask(self.upcoming(epoch, index, self.ahead(span)), ahead=True)

    def wait_ready(self, sample_ids: list[int]) -> None:
        """Wait until each of ``sample_ids`` has its file or failed (the held-out files, the vocabulary's)."""
        started = time.monotonic()
        while missing := [i for i in sample_ids if not self.ready(i) and not self._failed(i)]:
            if self.leader:
                self.tend(missing, set(sample_ids), 0, 0)
            time.sleep(POLL_S)
        if self.leader:
            self.keep_room([])
            self.waited_s += time.monotonic() - started
            self._measure(present(self.state, self.plan.validation_ids))

    def let_go(self, sample_id: int) -> None:
        """Delete a file no step has read (the draft vocabulary's count, beyond what training reads first): it is
        extracted again when training comes to it."""
        release(self.state, sample_id)
        self.asked.pop(sample_id, None)

    def released_after_checkpoint(self, epoch: int, index: int, span: int) -> int:
        """Delete the files read since the last checkpoint that no step ahead reads; returns how many."""
        if not self.leader:
            return 0
        keep = set(self.upcoming(epoch, index, self.ahead(span)))
        gone = sorted(self.unreleased - keep)
        for sample_id in gone:
            release(self.state, sample_id)
            self.asked.pop(sample_id, None)  # gone from the volume: the next epoch asks for it afresh
        # Those kept are read again soon (the next epoch's first samples): that read counts them again.
        self.unreleased = set()
        return len(gone)

    def tend(self, missing: list[int], keep: set[int], epoch: int, index: int,
             relieve: Callable[[], None] = lambda: None) -> None:
        """One look, on rank 0, while it waits for ``missing`` (of ``keep``, the samples waited for at ``epoch``'s
        batch ``index``): room kept for them; with the spool full, ``relieve`` (a checkpoint that releases what was
        read) first, else later unread files deleted to bring it within budget and the first missing named the
        one that may pass it; files no job will make ready cleared; and the missing asked for."""
        self.keep_room(missing)
        full = self.spool_full()
        if full and self.unreleased:
            relieve()  # files already read go first; only a spool full of files ahead lets one past
        head = full and not self.unreleased
        if head:
            self.make_room(keep, epoch, index)
        self.state.set_meta(**{ONLINE_HEAD: missing[0] if head else ""})
        self.clear_orphans(missing)
        self.ask(missing, lost=True)

    def keep_room(self, missing: list[int]) -> None:
        """Keep room in the budget for ``missing`` (the samples of the batch read next that have no file yet), at the
        mean size measured: claims of other samples must leave it free (``runtime.disk_claims``)."""
        if missing == self.kept_for and time.monotonic() - self.kept_at < KEEP_AGAIN_S:
            return
        self.kept_for, self.kept_at = list(missing), time.monotonic()
        self.state.set_meta(**{ONLINE_BATCH: ",".join(str(i) for i in missing),
                               ONLINE_RESERVE: int(len(missing) * self.mean_bytes)})

    def make_room(self, keep: set[int], epoch: int, index: int) -> None:
        """Before the sample waited for may pass the budget: delete files of later samples that no step has read
        (not in ``keep``, the batch waited for), the farthest ahead first, until the spool is within its budget
        (another sample that passed it before may have left it over), so that sample passes it by one file at
        most. When only ``keep``'s files are left and they exceed the budget, the batch passes it anyway (said
        once)."""
        room = self.budget - spool_bytes(self.state.conn, self.state.run)
        if room >= 0:
            return
        let_go = []
        # Each sample by when training next reads it (its first place ahead; the next epoch reads it again later).
        for sample_id in reversed(list(dict.fromkeys(self.upcoming(epoch, index, MAX_AHEAD)))):
            if room >= 0:
                break
            if sample_id in keep or sample_id in self.unreleased or not self.ready(sample_id):
                continue  # a file not yet counted by its extractor is not the trainer's to delete
            room += release(self.state, sample_id, counter=ONLINE_EVICTED)
            self.asked.pop(sample_id, None)
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
        return spool + self.mean_bytes > self.budget or time.time() - refused < REFUSED_RECENTLY_S

    def report(self, epoch: int, trained_in_epoch: int, *, force: bool = False) -> None:
        """The trainer's time, waits and epoch progress into the run's meta (at most once a second)."""
        now = time.monotonic()
        if not self.leader or (not force and now - self.last_report < 1.0):
            return
        add_seconds(self.state.conn, self.state.run, ONLINE_TRAIN_S, now - self.last_report)
        add_seconds(self.state.conn, self.state.run, ONLINE_WAIT_S, self.waited_s)
        self.state.set_meta(**{ONLINE_EPOCH: epoch, ONLINE_EPOCH_TRAINED: trained_in_epoch})
        self.waited_s, self.last_report = 0.0, now

    # ---- on every rank: waiting for a batch -------------------------------------------------

    def _batch_ids(self, epoch: int, index: int) -> list[int]:
        return [self.plan.train_ids[i] for i in self.plans[epoch][index]]

    def ready(self, sample_id: int) -> bool:
        """The sample's file is on the volume, its shard's manifest names this version of it (the extractor appends
        the entry, with the file's modification time, only after verifying the file: ``names_version``), and the
        extractor has counted it (its done bit, set last)."""
        path = self.paths.hidden(sample_id)
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            return False
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
        if self.leader and sample_id not in self.sizes:
            self.sizes[sample_id] = entry.bytes
            self.mean_bytes = sum(self.sizes.values()) / len(self.sizes)
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

    def _all_settled(self, ids: list[int]) -> bool:
        return all(self.ready(i) or self._failed(i) for i in ids)

    def wait_for(self, epoch: int, index: int, span: int, relieve: Callable[[], None] = lambda: None) -> list[int]:
        """Wait until every sample of the global batch has its file or failed; returns the batch to train as
        indices into the plan's training ids (in the batch's order). Rank 0 asks ahead meanwhile, names the
        sample it waits for, and calls ``relieve`` (a checkpoint, then ``released_after_checkpoint``) when the
        spool is full of files it has read."""
        ids = self._batch_ids(epoch, index)
        started = time.monotonic()
        while True:
            missing = [i for i in ids if not self.ready(i) and not self._failed(i)]
            if not missing:
                break
            if self.leader:
                self.tend(missing, set(ids), epoch, index, relieve)
                self.ask_ahead(epoch, index, span)
            time.sleep(POLL_S)
        self.evicted.clear()  # the batch is whole: what made room for it is asked for again as training nears it
        waited = time.monotonic() - started
        if self.leader:
            self.waited_s += waited
            if waited > POLL_S:
                self.state.set_meta(**{ONLINE_HEAD: ""})
            # The next step's files get the room as soon as this one's are in: they are the next to be read.
            self.keep_room([i for i in self.upcoming(epoch, index + 1, span) if not self.ready(i)])
        batch = [i for i in self.plans[epoch][index] if self.plan.train_ids[i] not in self.failed]
        if not batch:
            raise GlobalBatchFailed(f"every sample of epoch {epoch}'s batch {index} ({ids}) failed extraction")
        self.batches[(epoch, index)] = batch
        return batch

    def read(self, epoch: int, index: int) -> tuple[list[int], list[int]]:
        """``(indices, sample ids)`` of what batch ``index`` of ``epoch`` trains (after ``wait_for``), now
        counted as read."""
        batch = self.batches.pop((epoch, index))
        ids = [self.plan.train_ids[i] for i in batch]
        self.unreleased.update(ids)
        return batch, ids


# ---- what the first start learned, for every resume ------------------------------------------------

FACTS = "facts"  # the plan file's record of what the first start measured: epochs, target, DFlash's mask token


def plan_facts(paths: RunPaths) -> dict | None:
    """What the first start recorded in the plan (None before it did)."""
    try:
        facts = read_json(paths.online_plan).get(FACTS)
    except (OSError, ValueError, AttributeError):
        return None
    return facts if isinstance(facts, dict) else None


def record_facts(paths: RunPaths, facts: dict) -> None:
    raw = read_json(paths.online_plan)
    raw[FACTS] = facts
    write_with_space(lambda: atomic_write_json(paths.online_plan, raw), "the online plan's facts", paths.data)


def wait_for_facts(paths: RunPaths) -> dict:
    """On a rank other than 0: rank 0's facts, once written."""
    deadline = time.monotonic() + PLAN_WAIT_S
    while (facts := plan_facts(paths)) is None:
        if time.monotonic() > deadline:
            raise OnlinePlanError(f"{paths.online_plan}: rank 0 recorded no facts within {PLAN_WAIT_S:.0f}s")
        time.sleep(POLL_S)
    return facts
