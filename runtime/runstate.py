"""A run's to-do list and counters in Redis, and its named failures on the volume.

Per-sample outcomes are Redis bitmaps indexed by sample id (1.4M samples cost 175 KB per bitmap), so
marking a sample twice never counts it twice. Failures are also written to the volume, which stays the
truth if Redis is lost.

Throughput is counted in time buckets: a Redis hash per stage, one field per ``RATE_BUCKET_SECONDS``
bucket, incremented once each time a sample goes from unsettled to settled (done, failed or dropped:
the same outcomes that ``remaining`` subtracts). Buckets older than the window are pruned when a new
bucket begins, so the hash holds at most ``RATE_BUCKETS`` counts, ``begun`` and ``last`` whatever the
rate. See ``Throughput`` for the rate and ETA rules.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import redis

from shared.atomic import atomic_write_json, read_json
from shared.layout import RunPaths
from shared.lifecycle import (
    OUTCOMES,
    RUNS_KEY,
    SAMPLE_STAGES,
    TERMINAL_PHASES,
    Failure,
    FailureKind,
    Outcome,
    RunKeys,
    RunPhase,
    Stage,
    StageState,
    advance,
    failure_field,
    phase_for_stage,
    sample_stage,
)

log = logging.getLogger(__name__)
FINISHED_FILE = "state.json"  # runs/<run>/state.json: the run's terminal record


PREFIX = "draftline"

RATE_BUCKET_SECONDS = 5  # width of one throughput bucket
RATE_WINDOW_SECONDS = 300  # a rate averages the settled samples of at most this many recent seconds
RATE_BUCKETS = RATE_WINDOW_SECONDS // RATE_BUCKET_SECONDS  # buckets in the window, the current one included
RATE_MIN_SPAN_SECONDS = 30.0  # a rate needs this long an observation: a batch landing at once is not a rate
ETA_MIN_SETTLED = 10  # an ETA needs at least this many samples settled in the window
BEGUN = "begun"  # field of a throughput hash: when the current observation of the stage began
LAST = "last"  # field of a throughput hash: when the stage last settled a sample
FIRST = "first"  # field of a throughput hash: when the stage first settled a sample (never reset)
TOTAL = "total"  # field of a throughput hash: samples the stage ever settled (never pruned)
FIELDS = (BEGUN, LAST, FIRST, TOTAL)  # the hash's fields that are not buckets
GENERATE_REQUESTS = "generate_requests"  # run meta: requests the target answered (a turn each; retries aside)
# run meta, set when the run's state was rebuilt from the volume after its replies were made: the count above
# began again at the rebuild (reply files do not say how many requests made them), so the run's total is unknown
GENERATE_REQUESTS_UNCOUNTED = "generate_requests_uncounted"



# KEYS: the stage's done, failed and dropped bitmaps, the run's failures hash, its meta hash.
# ARGV: stage, n, n meta field names, then per sample: its id and its n amounts. Returns each sample's
# (done, failed, dropped) bits as they were before. The counts of the samples newly done are summed, one
# HINCRBYFLOAT per field.
_MARK_DONE = """
local stage, n = ARGV[1], tonumber(ARGV[2])
local was, sums, i = {}, {}, 3 + n
for j = 1, n do sums[j] = 0 end
while i <= #ARGV do
  local sample = ARGV[i]
  local done = redis.call('SETBIT', KEYS[1], sample, 1)
  was[#was + 1] = done
  was[#was + 1] = redis.call('SETBIT', KEYS[2], sample, 0)
  was[#was + 1] = redis.call('SETBIT', KEYS[3], sample, 0)
  redis.call('HDEL', KEYS[4], stage .. ':' .. sample)
  if done == 0 then
    for j = 1, n do sums[j] = sums[j] + tonumber(ARGV[i + j]) end
  end
  i = i + 1 + n
end
for j = 1, n do
  if sums[j] ~= 0 then redis.call('HINCRBYFLOAT', KEYS[5], ARGV[2 + j], string.format('%.17g', sums[j])) end
end
return was
"""


@dataclass(frozen=True)
class StageCounts:
    """How many samples of a per-sample stage settled as each ``Outcome``."""

    done: int
    failed: int
    dropped: int

    @property
    def settled(self) -> int:
        return self.done + self.failed + self.dropped

    @property
    def unverified(self) -> int:
        """Settled without a verified output: failed or dropped."""
        return self.failed + self.dropped


@dataclass(frozen=True)
class Throughput:
    """Samples of a stage settled in the last ``span_s`` seconds, and the rate and ETA they support.

    The span is ``now`` minus the later of two times: the start of the window (the oldest of its
    ``RATE_BUCKETS`` buckets, so ``RATE_WINDOW_SECONDS - RATE_BUCKET_SECONDS <= span_s <
    RATE_WINDOW_SECONDS`` once the window is full) and the stage's first settled sample after a quiet
    spell of a whole window (or ever). Count and span cover the same interval, so for a stage settling
    ``r`` samples/s in bursts of at most ``b`` samples, ``|per_second - r| <= b / span_s``.
    """

    settled: int
    span_s: float

    @property
    def per_second(self) -> float | None:
        """0 when nothing settled in the window; None (unknown) while the span is under
        ``RATE_MIN_SPAN_SECONDS``; else settled / span."""
        if self.settled == 0:
            return 0.0
        if self.span_s < RATE_MIN_SPAN_SECONDS:
            return None
        return self.settled / self.span_s

    def eta_seconds(self, remaining: int) -> float | None:
        """0 when nothing remains; else remaining / rate once the rate is known, is above 0 and rests on at
        least ``ETA_MIN_SETTLED`` samples; None (unknown) otherwise."""
        if remaining <= 0:
            return 0.0
        rate = self.per_second
        if not rate or self.settled < ETA_MIN_SETTLED:
            return None
        return remaining / rate


class RunState:
    """Counters and failures of one run."""

    def __init__(self, conn: redis.Redis, data: Path, run: str) -> None:
        self.conn = conn
        self.paths = RunPaths(Path(data), run)
        self.run = run
        self.keys = RunKeys(run)

    # ---- registration and metadata -------------------------------------------------------------
    def register(self, expected: int, **meta: object) -> None:
        fields = {"name": self.run, "expected": expected, "created_at": time.time(), **meta}
        pipe = self.conn.pipeline()
        pipe.sadd(RUNS_KEY, self.run)
        pipe.hset(self.keys.meta, mapping={k: str(v) for k, v in fields.items()})
        pipe.execute()

    def meta(self) -> dict[str, str]:
        raw = self.conn.hgetall(self.keys.meta)
        return {_s(k): _s(v) for k, v in raw.items()}

    def set_meta(self, **fields: object) -> None:
        self.conn.hset(self.keys.meta, mapping={k: str(v) for k, v in fields.items()})

    def phase(self) -> RunPhase:
        return RunPhase.of(_s(self.conn.hget(self.keys.meta, "state") or ""))

    def set_phase(self, new: RunPhase, **fields: object) -> None:
        """Move the run to phase ``new`` (IllegalTransition unless ``shared.lifecycle`` allows it), writing
        ``fields`` in the same HSET."""
        self._transition("state", RunPhase.of, RunPhase(new), fields)

    def set_stage(self, stage: Stage, new: StageState, **fields: object) -> RunPhase:
        """Move whole-run ``stage`` to ``new`` and the run to the phase that gives it (``phase_for_stage``),
        both checked by ``advance`` and written with ``fields`` in one transaction; returns the run's phase.

        A run that leaves a terminal phase (a failed run's job running again) loses its finished record on the
        volume first, then ``finished_at``: the supervisor records the run's end again when it comes."""
        stage = Stage(stage)
        if stage.per_sample:
            raise ValueError(f"{stage} is a per-sample stage; whole-run stages are train and evaluate")
        # Counted before the transaction: no sample settles once the run trains (its sample stages are over).
        unverified = self.unverified() if stage is Stage.EVALUATE and new in (StageState.DONE, StageState.SKIPPED) else 0
        key, field = self.keys.meta, f"{stage}_state"

        def check_and_write(pipe: redis.client.Pipeline) -> RunPhase:
            stored_stage, stored_phase = pipe.hmget(key, [field, "state"])
            advance(StageState.of(_s(stored_stage or "")), StageState(new))
            before = RunPhase.of(_s(stored_phase or ""))
            phase = advance(before, phase_for_stage(stage, StageState(new), unverified=unverified) or before)
            leaves_end = before.terminal and phase is not before
            if leaves_end:
                finished_path(self.paths).unlink(missing_ok=True)
            pipe.multi()
            pipe.hset(key, mapping={field: StageState(new).value, "state": phase.value,
                                    **{k: str(v) for k, v in fields.items()}})
            if leaves_end:
                pipe.hdel(key, "finished_at")
            return phase

        # WATCH: the supervisor, a retry and the trainer must not move the run from the same state at once.
        return self.conn.transaction(check_and_write, key, value_from_callable=True)

    def _transition(self, field: str, parse: Callable[[str], RunPhase | StageState], new: RunPhase | StageState,
                    fields: dict[str, object]) -> None:
        key = self.keys.meta

        def check_and_write(pipe: redis.client.Pipeline) -> None:
            advance(parse(_s(pipe.hget(key, field) or "")), new)
            pipe.multi()
            pipe.hset(key, mapping={field: new.value, **{k: str(v) for k, v in fields.items()}})

        # WATCH: two writers (the supervisor and a retry) must not both move from the same state.
        self.conn.transaction(check_and_write, key)

    def incr(self, field: str, amount: int | float = 1) -> float:
        """Add to a numeric meta field (bytes written, tokens seen) atomically."""
        return float(self.conn.hincrbyfloat(self.keys.meta, field, amount))

    def incr_many(self, amounts: dict[str, int | float]) -> None:
        """``incr`` for several fields in one round trip; fields whose amount is 0 are left alone."""
        pipe = self.conn.pipeline(transaction=False)
        for field, amount in amounts.items():
            if amount:
                pipe.hincrbyfloat(self.keys.meta, field, amount)
        pipe.execute()

    def expected(self) -> int:
        return int(self.meta().get("expected", 0))

    def note_retry(self, stage: str) -> None:
        """Count one more attempt at a sample of ``stage`` after a transient error or a lost job."""
        self.incr(retried_field(sample_stage(stage)))

    # ---- per-sample outcomes -------------------------------------------------------------------
    def mark_done(self, stage: str, sample_id: int, *, landed: Mapping[str, float] | None = None,
                  now: float | None = None) -> bool:
        """Record a verified sample; True when it was not done before. Clears an earlier failure.

        ``landed`` holds the sample's own meta counts (its file's bytes and tokens); they are added in the
        same atomic step as the done bit, and only when the sample was not done before (see
        ``mark_done_many``). Counts toward the stage's throughput (at ``now``) only when the sample was not
        settled before."""
        return bool(self.mark_done_many(stage, [sample_id], landed={sample_id: landed} if landed else None,
                                        now=now))

    def mark_done_many(self, stage: str, sample_ids: Iterable[int], *,
                       landed: Mapping[int, Mapping[str, float]] | None = None,
                       now: float | None = None) -> list[int]:
        """``mark_done`` for several samples in one atomic step; returns the ids that were not done before.

        The done bits and the ``landed`` counts of the samples newly done change together in one Lua script,
        so a worker killed between "done" and "counted" cannot exist: a sample's bytes are counted exactly
        once, however often its job is killed and run again. A job that settles many samples at once pays one
        round trip instead of two per sample."""
        stage = sample_stage(stage)
        ids = list(sample_ids)
        if not ids:
            return []
        landed = landed or {}
        fields = sorted({field for counts in landed.values() for field in counts})
        args: list[object] = [stage, len(fields), *fields]
        for sample_id in ids:
            counts = landed.get(sample_id, {})
            args += [sample_id, *(repr(float(counts.get(field, 0))) for field in fields)]
        keys = [self.keys.outcome(stage, outcome) for outcome in OUTCOMES]
        before = self.conn.eval(_MARK_DONE, 5, *keys, self.keys.failures, self.keys.meta,
                                *args)
        for sample_id in ids:
            self.paths.failure(stage, sample_id).unlink(missing_ok=True)
        was = [before[i:i + 3] for i in range(0, len(before), 3)]  # (done, failed, dropped) before, per sample
        settled = sum(1 for bits in was if not any(bits))
        if settled:
            self._count_settled(stage, time.time() if now is None else now, settled)
        return [sample_id for sample_id, (was_done, _, _) in zip(ids, was) if not was_done]

    def mark_failed(self, failure: Failure, *, count_in_rate: bool = True) -> None:
        """Record a named failure on the volume first, then in Redis.

        Counts toward the stage's throughput (at ``failure.at``) when the sample was not settled before,
        unless ``count_in_rate`` is False: rows named at submission are not work the stage did."""
        stage = sample_stage(failure.stage)
        if not failure.at:
            failure = Failure(**{**asdict(failure), "at": time.time()})
        atomic_write_json(self.paths.failure(stage, failure.sample_id), asdict(failure))
        pipe = self.conn.pipeline()  # a MULTI/EXEC: the outcomes read are the ones the setbit replaced
        for outcome in OUTCOMES:
            pipe.getbit(self.keys.outcome(stage, outcome), failure.sample_id)
        pipe.setbit(self.keys.outcome(stage, FailureKind(failure.kind).outcome), failure.sample_id, 1)
        pipe.hset(self.keys.failures, failure.field, failure.to_json())
        *before, _, _ = pipe.execute()
        if count_in_rate and not any(before):
            self._count_settled(failure.stage, failure.at)

    def clear_failure(self, stage: str, sample_id: int) -> None:
        """Forget a failure so the sample can run again: the volume record first, then Redis."""
        stage = sample_stage(stage)
        self.paths.failure(stage, sample_id).unlink(missing_ok=True)
        pipe = self.conn.pipeline()
        pipe.setbit(self.keys.outcome(stage, Outcome.FAILED), sample_id, 0)
        pipe.setbit(self.keys.outcome(stage, Outcome.DROPPED), sample_id, 0)
        pipe.hdel(self.keys.failures, failure_field(stage, sample_id))
        pipe.execute()

    def clear_done(self, stage: str, sample_id: int) -> None:
        """Forget that a sample finished ``stage`` (its output is gone and must be made again)."""
        self.conn.setbit(self.keys.outcome(stage, Outcome.DONE), sample_id, 0)

    def outcomes(self, stage: str, start: int, stop: int) -> dict[Outcome, np.ndarray]:
        """``{Outcome: bool array}`` for sample ids ``start..stop-1`` (one round trip)."""
        stage = sample_stage(stage)
        pipe = self.conn.pipeline()
        for outcome in OUTCOMES:
            pipe.getrange(self.keys.outcome(stage, outcome), start // 8, max(stop - 1, start) // 8)
        return {o: bits_in_range(raw, start, stop) for o, raw in zip(OUTCOMES, pipe.execute())}

    def is_done(self, stage: str, sample_id: int) -> bool:
        return bool(self.conn.getbit(self.keys.outcome(stage, Outcome.DONE), sample_id))

    def unverified(self) -> int:
        """Samples that settled without a verified file: failed or dropped in either per-sample stage. A sample
        counts once: one that failed generation never reaches extraction."""
        return sum(self.counts(stage).unverified for stage in SAMPLE_STAGES)

    def counts(self, stage: str) -> StageCounts:
        stage = sample_stage(stage)
        pipe = self.conn.pipeline()
        for outcome in OUTCOMES:
            pipe.bitcount(self.keys.outcome(stage, outcome))
        done, failed, dropped = pipe.execute()
        return StageCounts(done=done, failed=failed, dropped=dropped)

    def failures(self, stage: str | None = None) -> list[Failure]:
        raw = self.conn.hgetall(self.keys.failures)
        found = [Failure.from_json(v) for v in raw.values()]
        if stage:
            found = [f for f in found if f.stage == stage]
        return sorted(found, key=lambda f: (f.stage, f.sample_id))

    # ---- throughput ----------------------------------------------------------------------------
    def throughput(self, stage: str, now: float | None = None, *, finished: bool = False) -> Throughput:
        """Samples of ``stage`` settled in the recent window (one HGETALL); see ``Throughput``.

        A ``finished`` stage (nothing left to settle) reads its own rate: every sample it settled over the time
        from its first settled sample to its last, so neither the idle time after it nor a slow last window
        stands for the whole stage."""
        now = time.time() if now is None else now
        raw = {_s(k): _s(v) for k, v in self.conn.hgetall(self.keys.settled(stage)).items()}
        begun = float(raw.pop(BEGUN, "inf"))
        last = float(raw.pop(LAST, "inf"))
        first, total = raw.pop(FIRST, None), raw.pop(TOTAL, None)
        if finished and first is not None and total is not None:
            return Throughput(settled=int(total), span_s=max(last - float(first), 0.0))
        if finished:  # a hash written before FIRST and TOTAL existed: its last window, ended at its last sample
            now = min(now, last)
        window_start = float((_bucket(now) - RATE_BUCKETS + 1) * RATE_BUCKET_SECONDS)
        start = max(begun, window_start)
        if start == float("inf"):  # nothing ever settled
            return Throughput(settled=0, span_s=0.0)
        # Later buckets count too: a worker whose clock runs ahead of this one settled them all the same.
        settled = sum(int(count) for bucket, count in raw.items() if int(bucket) >= _bucket(start))
        return Throughput(settled=settled, span_s=max(now - start, 0.0))

    def _count_settled(self, stage: str, at: float, count: int = 1) -> None:
        """``count`` more samples of ``stage`` settled at ``at``: O(1) commands, plus a prune per new bucket."""
        key, bucket = self.keys.settled(stage), _bucket(at)
        pipe = self.conn.pipeline(transaction=False)
        pipe.hincrby(key, str(bucket), count)
        pipe.hsetnx(key, BEGUN, repr(at))
        pipe.hsetnx(key, FIRST, repr(at))
        pipe.hincrby(key, TOTAL, count)
        pipe.hset(key, LAST, repr(at))
        in_bucket, *_ = pipe.execute()
        if in_bucket == count:  # the bucket was empty: the first settled in it
            self._prune(key, bucket, at)

    def _prune(self, key: str, bucket: int, at: float) -> None:
        """Drop buckets that left the window; after a quiet window, ``at`` begins a new observation."""
        buckets = [int(_s(f)) for f in self.conn.hkeys(key) if _s(f) not in FIELDS]
        # Relative to the newest bucket, not this one: a worker whose clock lags must not keep old ones.
        stale = [str(b) for b in buckets if b <= max(buckets) - RATE_BUCKETS]
        pipe = self.conn.pipeline(transaction=False)
        if stale:
            pipe.hdel(key, *stale)
        if not any(b != bucket and b > bucket - RATE_BUCKETS for b in buckets):
            # Nothing else settled within a window of this sample: measuring from the old beginning would
            # spread it over a whole window of idle time.
            pipe.hset(key, BEGUN, repr(at))
        pipe.execute()

    # ---- whole-run stages (train, evaluate) ----------------------------------------------------
    def set_progress(self, stage: str, done: int, total: int, **extra: object) -> None:
        self.set_meta(**{f"{stage}_done": done, f"{stage}_total": total}, **{f"{stage}_{k}": v for k, v in extra.items()})

    def progress(self, stage: str) -> tuple[int, int]:
        meta = self.meta()
        return int(meta.get(f"{stage}_done", 0)), int(meta.get(f"{stage}_total", 0))

    def delete(self) -> None:
        keys = list(self.conn.scan_iter(match=self.keys.pattern))
        if keys:
            self.conn.delete(*keys)
        self.conn.srem(RUNS_KEY, self.run)


def bits_in_range(raw: bytes, start: int, stop: int) -> np.ndarray:
    """Bits ``start..stop-1`` of a bitmap, given the bytes from ``start // 8`` on (GETRANGE's answer).

    Redis numbers the bits of a byte from the most significant one, as ``np.unpackbits`` does."""
    count = max(stop - start, 0)
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8)).astype(bool)
    offset = start % 8
    window = bits[offset:offset + count]
    return np.concatenate([window, np.zeros(count - len(window), dtype=bool)]) if len(window) < count else window


def bitmap_ids(raw: bytes | None) -> list[int]:
    """Every id whose bit is set in a whole bitmap (a GET answer)."""
    if not raw:
        return []
    return np.flatnonzero(np.unpackbits(np.frombuffer(raw, dtype=np.uint8))).tolist()


def ids_bitmap(ids: Iterable[int]) -> bytes:
    """A bitmap with exactly ``ids`` set, in Redis' bit order (for SET, then BITOP)."""
    ids = np.fromiter(ids, dtype=np.int64)
    if ids.size == 0:
        return b""
    bits = np.zeros(int(ids.max()) + 1, dtype=bool)
    bits[ids] = True
    return np.packbits(bits).tobytes()


def _bucket(at: float) -> int:
    return int(at // RATE_BUCKET_SECONDS)


def retried_field(stage: str) -> str:
    """The meta field counting retries of a per-sample stage (exported as draftline_stage_retried_total)."""
    return f"{stage}_retried"


def known_runs(conn: redis.Redis) -> list[str]:
    return sorted(_s(r) for r in conn.smembers(RUNS_KEY))


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# ---- the finished-run record on the volume: it outlives Redis ---------------------------------------


def finished_path(paths: RunPaths) -> Path:
    return paths.root / FINISHED_FILE


def read_finished(paths: RunPaths) -> dict | None:
    """The run's terminal record, or None while the run is unfinished."""
    try:
        record = read_json(finished_path(paths))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("%s: unreadable (%s); treating run %s as unfinished", finished_path(paths), exc, paths.run)
        return None
    return record if isinstance(record, dict) and record.get("state") in TERMINAL_PHASES else None


FINISHED_META = "meta"  # the whole-run stages' fields a finished record keeps for a Redis that lost the run
_KEPT_PREFIXES = ("train_state", "train_error", "train_finished_at", "train_warning", "evaluate_state",
                  "evaluate_error", "online_")  # online_: an online run's spool and trainer figures (runtime.spool)
_KEPT_FIELDS = ("export_path", "acceptance_length", "error")


def finished_meta(meta: dict[str, str]) -> dict[str, str]:
    """What a finished run's record keeps of its meta: how its training and evaluation ended and why, its export
    and its acceptance, so that status and ``retry`` read the same after Redis lost the run."""
    return {k: v for k, v in meta.items() if k in _KEPT_FIELDS or k.startswith(_KEPT_PREFIXES)}


def write_finished(state: RunState, final: RunPhase) -> dict:
    """Mark the run finished on the volume, then in Redis; IllegalTransition before either when the run's
    phase cannot move to ``final``."""
    final = advance(state.phase(), RunPhase(final))  # checked first: a refused phase reaches neither store
    record = {"run": state.run, "state": final, "finished_at": time.time(), "expected": state.expected(),
              **{stage: asdict(state.counts(stage)) for stage in SAMPLE_STAGES},
              FINISHED_META: finished_meta(state.meta())}
    atomic_write_json(finished_path(state.paths), record)
    state.set_phase(final, finished_at=record["finished_at"])
    return record
