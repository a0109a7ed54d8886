"""An online run's spool: its hidden-state files on the volume, held within the run's byte budget.

An online run (``online.enabled``) keeps a sample's file only while training still needs it. The files lie where
an offline run's do (``RunPaths.hidden``), so extraction, verification, the manifest and a resume treat them
alike; what differs is their life:

- **landing**: an extraction claims its file's bytes before it asks for the states (``runtime.disk_claims``);
  for an online run the claim is granted only while the spool's bytes (``hidden_bytes`` in the run's meta, which
  each landed file adds to) plus every claim being written plus this one fit the budget. The one sample the
  trainer is waiting for (``ONLINE_HEAD``) is granted as far as the disk allows, so a spool filled with files
  the trainer needs later can never keep it waiting for good. Before that, the trainer keeps room for the files
  its batch still misses (``ONLINE_RESERVE``, at the mean size): a claim of a later sample must leave that room
  free, so files asked for ahead cannot take the place of those the next step reads (a worker that deferred one of
  them sends it to the back of the queue). The trainer names the head only once the spool is within its
  budget, deleting files of later samples it has not read to bring it back there (``make_room`` in
  ``services.trainer.online``: they are extracted again when training comes to them): the spool peaks at the budget
  plus one file, as long as a global batch's files fit the budget.
- **release**: once the optimizer step that read a file is done, the trainer deletes it (``release``) unless the
  samples it asks for next include it again: the file goes, then its done bit and its bytes and tokens leave the
  run's counts in one atomic step, so the feeder of the next epoch (the trainer itself) extracts it again from the
  stored reply, and so does a resume for the steps after its checkpoint.
- **resync**: a trainer that starts (or resumes) makes the counts equal to the files on the volume first, so a
  process killed between a deletion and its count leaves nothing behind.

The trainer's waits and the extractors' blocked time are kept in the run's meta, as cumulative seconds, for
status and Prometheus to turn into fractions (``online_status``), beside the trainer's window: how many files,
steps and bytes it has asked for ahead, and whether the budget or the measured rates bound it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

import redis

from runtime.disk import HIDDEN_BYTES, HIDDEN_TOKENS, _number, _s
from runtime.runstate import RunState
from shared.errors import HiddenStateFileError
from shared.hidden_file import read_header
from shared.lifecycle import Outcome, RunKeys, Stage
from shared.runspec import cached_spec

log = logging.getLogger(__name__)

# Fields of the run's meta hash (online runs only).
ONLINE_HEAD = "online_head"  # the sample the trainer waits for now; "" while it waits for none
ONLINE_BATCH = "online_batch"  # the samples of the batch the trainer waits for that have no file yet, comma-separated
ONLINE_RESERVE = "online_reserve"  # bytes the budget keeps for them: claims of other samples must leave them free
ONLINE_STARTED_AT = "online_started_at"  # the trainer's first start (wall clock)
ONLINE_WAIT_S = "online_wait_s"  # seconds the trainer has waited for files, all sessions
ONLINE_TRAIN_S = "online_train_s"  # seconds the trainer has been running, all sessions (waits included)
ONLINE_BLOCKED_S = "online_blocked_s"  # seconds extractions waited for the budget, summed over extractors
ONLINE_EXTRACT_S = "online_extract_s"  # seconds extractions took once granted (states, file, verification), summed
ONLINE_REFUSED_AT = "online_refused_at"  # when the budget last refused an extraction's claim (wall clock)
ONLINE_EPOCH = "online_epoch"  # the epoch the trainer is in
ONLINE_EPOCH_TRAINED = "online_epoch_trained"  # samples trained so far in that epoch
ONLINE_EPOCH_SAMPLES = "online_epoch_samples"  # samples an epoch trains
ONLINE_RELEASED = "online_released"  # files deleted after the step that read them, all epochs
ONLINE_EVICTED = "online_evicted"  # files of later samples deleted unread to make room for the one waited for
ONLINE_PEAK_BYTES = "online_peak_bytes"  # the most bytes the spool's counts held at once
ONLINE_LANDED = "online_landed"  # files extractions have landed, all epochs (the trainer's measure of their rate)
ONLINE_WINDOW_FILES = "online_window_files"  # samples the trainer has asked for ahead, the batch it reads next first
ONLINE_WINDOW_STEPS = "online_window_steps"  # the global batches they reach into
ONLINE_WINDOW_BYTES = "online_window_bytes"  # their files' estimated bytes
ONLINE_WINDOW_LIMIT = "online_window_limit"  # what bounds the window (WindowLimit)
ONLINE_FIELDS = (ONLINE_HEAD, ONLINE_BATCH, ONLINE_RESERVE, ONLINE_STARTED_AT, ONLINE_WAIT_S, ONLINE_TRAIN_S,
                 ONLINE_BLOCKED_S, ONLINE_EXTRACT_S, ONLINE_REFUSED_AT, ONLINE_EPOCH, ONLINE_EPOCH_TRAINED,
                 ONLINE_EPOCH_SAMPLES, ONLINE_RELEASED, ONLINE_EVICTED, ONLINE_PEAK_BYTES, ONLINE_LANDED,
                 ONLINE_WINDOW_FILES, ONLINE_WINDOW_STEPS, ONLINE_WINDOW_BYTES, ONLINE_WINDOW_LIMIT)


class WindowLimit(StrEnum):
    """What bounds the samples an online trainer asks for ahead."""

    BUDGET = "budget"  # the byte budget holds no more beside the held-out files
    RATES = "rates"  # the measured extraction rate and step time need no more steps ahead
    END = "end"  # training ends within it
    UNMEASURED = "unmeasured"  # no file size known yet: one batch at a time
# An online run's default budget: this share of the volume's free space (less its reserve), so other runs and the
# checkpoints keep room.
DEFAULT_BUDGET_SHARE = 0.25
# Above this share of its time waiting for files, the trainer is the side starved: extraction is the bottleneck.
STARVED_FRACTION = 0.5

# KEYS: the extract stage's done bitmap, the run's meta. ARGV: sample id, bytes, tokens, the meta's field that counts
# the deletion. Clears the done bit and, only when it was set, takes the file's bytes and tokens off the counts and
# counts it; returns the bit as it was.
_RELEASE = """
local was = redis.call('SETBIT', KEYS[1], ARGV[1], 0)
if was == 1 then
  redis.call('HINCRBYFLOAT', KEYS[2], 'hidden_bytes', '-' .. ARGV[2])
  redis.call('HINCRBYFLOAT', KEYS[2], 'hidden_tokens', '-' .. ARGV[3])
  redis.call('HINCRBY', KEYS[2], ARGV[4], 1)
end
return was
"""


def budget_of(state: RunState) -> int | None:
    """The run's byte budget when it trains online, else None."""
    online = cached_spec(state.paths.data, state.run).online
    return online.budget_bytes if online.enabled else None


def file_counts(path) -> tuple[int, int]:
    """``(bytes, tokens)`` of a hidden-state file, from its size and its header (no tensor is read)."""
    header, _ = read_header(path)
    ids = header.get("input_ids")
    if not isinstance(ids, dict) or not ids.get("shape"):
        raise HiddenStateFileError(f"{path}: no input_ids in its header")
    return path.stat().st_size, int(ids["shape"][0])


def release(state: RunState, sample_id: int, *, counter: str = ONLINE_RELEASED) -> int:
    """Delete sample ``sample_id``'s file, take it off the run's counts and count it in ``counter`` (released
    after its step, or ``ONLINE_EVICTED``); returns the bytes freed (0 when it was gone already)."""
    return release_many(state, [sample_id], counter=counter)


def release_many(state: RunState, sample_ids: Iterable[int], *, counter: str = ONLINE_RELEASED) -> int:
    """``release`` of each of ``sample_ids``, their counts taken off in one round trip to Redis (the trainer releases
    a step's files between two steps); returns the bytes freed."""
    counts = []
    for sample_id in sample_ids:
        path = state.paths.hidden(sample_id)
        try:
            nbytes, tokens = file_counts(path)
        except (HiddenStateFileError, FileNotFoundError):
            nbytes, tokens = 0, 0
        path.unlink(missing_ok=True)
        counts.append((sample_id, nbytes, tokens))
    if not counts:
        return 0
    keys = state.keys
    with state.conn.pipeline(transaction=False) as pipe:
        for sample_id, nbytes, tokens in counts:
            pipe.eval(_RELEASE, 2, keys.outcome(Stage.EXTRACT, Outcome.DONE), keys.meta, sample_id, nbytes, tokens,
                      counter)
        pipe.execute()
    return sum(nbytes for _, nbytes, _ in counts)


def present(state: RunState, sample_ids: Iterable[int]) -> dict[int, tuple[int, int]]:
    """``{sample id: (bytes, tokens)}`` of the files of ``sample_ids`` on the volume now."""
    found = {}
    for sample_id in sample_ids:
        try:
            found[sample_id] = file_counts(state.paths.hidden(sample_id))
        except (HiddenStateFileError, FileNotFoundError):
            continue
    return found


def resync(state: RunState, sample_ids: Iterable[int]) -> dict[int, tuple[int, int]]:
    """Make the done bits and the spool's counts those of the files on the volume (the volume is the truth);
    returns the files found."""
    ids = list(sample_ids)
    found = present(state, ids)
    keys = state.keys
    done = keys.outcome(Stage.EXTRACT, Outcome.DONE)
    with state.conn.pipeline() as pipe:
        for sample_id in ids:
            pipe.setbit(done, sample_id, 1 if sample_id in found else 0)
        pipe.hset(keys.meta, mapping={HIDDEN_BYTES: sum(b for b, _ in found.values()),
                                      HIDDEN_TOKENS: sum(t for _, t in found.values())})
        pipe.execute()
    return found


def spool_bytes(conn: redis.Redis, run: str) -> int:
    return int(_number({HIDDEN_BYTES: _s(conn.hget(RunKeys(run).meta, HIDDEN_BYTES))}, HIDDEN_BYTES))


def note_peak(conn: redis.Redis, run: str) -> None:
    """A file landed: count it, and raise the recorded peak of the spool's counts to what they hold now."""
    conn.eval("local now = tonumber(redis.call('HGET', KEYS[1], 'hidden_bytes') or '0') "
              "local peak = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') "
              "redis.call('HINCRBY', KEYS[1], ARGV[2], 1) "
              "if now > peak then redis.call('HSET', KEYS[1], ARGV[1], string.format('%d', now)) end return 0",
              1, RunKeys(run).meta, ONLINE_PEAK_BYTES, ONLINE_LANDED)


def add_seconds(conn: redis.Redis, run: str, field: str, seconds: float) -> None:
    if seconds > 0:
        conn.hincrbyfloat(RunKeys(run).meta, field, round(seconds, 3))


@dataclass(frozen=True)
class OnlineStatus:
    """What an online run's spool and trainer are doing, as status and the exporter report it."""

    budget_bytes: int
    waiting_for: int | None  # the sample the trainer waits for now (its extraction passes the budget)
    spool_bytes: int
    spool_files: int
    peak_bytes: int
    epoch: int | None
    epoch_trained: int
    epoch_samples: int
    released: int  # files deleted after the step that read them
    evicted: int  # files of later samples deleted unread, to make room for the one waited for
    window_files: int  # samples asked for ahead (the batch read next first)
    window_steps: int  # the global batches they reach into
    window_bytes: int  # their files' estimated bytes
    window_limit: str | None  # what bounds the window (WindowLimit); None before the trainer set one
    train_wait_fraction: float | None  # of the trainer's running time, waiting for files
    extract_blocked_s: float  # summed over extractors
    extract_blocked_fraction: float | None  # of the extractions' time (blocked + extracting), blocked on the budget
    bottleneck: str  # "extraction" (the trainer starves), "training" (extraction waits on the budget), "unknown"

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def online_status(state: RunState, meta: dict[str, str], budget: int) -> OnlineStatus:
    wait, running = _number(meta, ONLINE_WAIT_S), _number(meta, ONLINE_TRAIN_S)
    fraction = wait / running if running > 0 else None
    blocked, working = _number(meta, ONLINE_BLOCKED_S), _number(meta, ONLINE_EXTRACT_S)
    blocked_fraction = round(blocked / (blocked + working), 4) if blocked + working > 0 else None
    if fraction is None:
        bottleneck = "unknown"
    elif fraction >= STARVED_FRACTION:
        bottleneck = "extraction"
    else:
        bottleneck = "training"
    epoch = meta.get(ONLINE_EPOCH)
    head = meta.get(ONLINE_HEAD)
    return OnlineStatus(
        budget, int(head) if head not in (None, "") else None, int(_number(meta, HIDDEN_BYTES)),
        state.counts(Stage.EXTRACT).done, int(_number(meta, ONLINE_PEAK_BYTES)),
        int(epoch) if epoch not in (None, "") else None, int(_number(meta, ONLINE_EPOCH_TRAINED)),
        int(_number(meta, ONLINE_EPOCH_SAMPLES)), int(_number(meta, ONLINE_RELEASED)), int(_number(meta, ONLINE_EVICTED)),
        int(_number(meta, ONLINE_WINDOW_FILES)), int(_number(meta, ONLINE_WINDOW_STEPS)),
        int(_number(meta, ONLINE_WINDOW_BYTES)), meta.get(ONLINE_WINDOW_LIMIT) or None,
        None if fraction is None else round(fraction, 4), round(blocked, 3), blocked_fraction, bottleneck)
