"""Disk headroom of a run: what its hidden states still need against what the volume has free.

Hidden-state files dominate a run's footprint (4 × hidden × dtype bytes per token), so the projection
covers them only:

    bytes still to come = samples not yet settled × tokens per sample × bytes per token

Both factors are *measured* once samples land (the extractor tallies ``hidden_bytes`` and
``hidden_tokens`` in the run's meta through ``landed_counts``). Before the first sample lands they are
*estimated* by a stated rule:

    tokens per sample ≈ min(prompt bytes per row / 4 + generation.max_tokens, extraction.max_length)
    bytes per token   = 4 × hidden_size × dtype bytes + 9      (3 auxiliary layers + the last layer,
                                                               plus an int64 token id and a uint8 mask)
                      = 4 × hidden_size + 8 + 9                 (fp8 storage: 1 byte a value, and four
                                                               bf16 scales a token)

Four bytes per prompt token is the usual size of English BPE text (JSON overhead makes it an
over-estimate, which is the safe side), and ``max_tokens`` is the longest reply a sample can get.

When the *measured* projection exceeds free space less a reserve, or free space drops below the
reserve, the controller's supervisor sets the run's pause flag; extraction jobs then wait in
``wait_for_headroom`` instead of failing, and the flag clears by itself once the projection fits again
(space freed, volume grown). The estimate alone never pauses a run: ``max_tokens`` bounds replies that
are often much shorter, and a run paused on an over-estimate would wait for space it does not need
before measuring anything. Preflight warns about it instead.

The supervisor checks between its rounds, and extraction can land many samples in one of them, so
each extraction also claims its own file's bytes before it asks for the states
(``runtime.disk_claims``): a claim is granted only while free space less the reserve covers it and every
claim still being written. A refused claim pauses the run too, recording what it needs
(``disk_paused_need``), and the supervisor clears that pause only once the need fits again. Everything
here is torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import redis

from runtime import shutdown
from shared.errors import DraftlineError, RunNotFound
from shared.runspec import RunSpec, cached_spec
from runtime.disk_training import reply_bytes, target_config, training_bytes
from runtime.runstate import RunState
from shared.lifecycle import RunKeys, Stage

log = logging.getLogger(__name__)

BYTES_PER_PROMPT_TOKEN = 4.0
HIDDEN_TENSORS_PER_TOKEN = 4  # three auxiliary layers and the last layer
TOKEN_OVERHEAD_BYTES = 9  # the int64 token id and the uint8 loss-mask entry
DEFAULT_DTYPE_BYTES = 2  # bf16, what real targets are served in
FP8_SCALE_BYTES = 2  # fp8 storage: one bf16 scale per token and stored layer
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "bfloat16": 2, "float16": 2, "float32": 4}
WAIT_LOG_EVERY_S = 60.0

# Fields of the run's meta hash.
HIDDEN_BYTES = "hidden_bytes"
HIDDEN_TOKENS = "hidden_tokens"
PAUSED = "disk_paused"  # the reason; present only while the run is paused
PAUSED_AT = "disk_paused_at"
PAUSED_NEED = "disk_paused_need"  # bytes a refused claim needs above the reserve; set by runtime.disk_claims
BYTES_PER_TOKEN_ESTIMATE = "disk_bytes_per_token_estimate"  # recorded at submission, used until samples land
PAUSE_HOLDS = (Stage.GENERATE, Stage.EXTRACT)  # the stages a disk pause holds back
WRITER_HOLDS = (Stage.GENERATE, Stage.TRAIN, Stage.EVALUATE)  # the stages whose writers wait for space themselves
HELD_PREFIX = "disk_held_"  # meta field per held writer stage: why it waits and when it last said so (StageHold)
HOLD_STALE_S = 180.0  # three of a waiting writer's tries (runtime.space.RETRY_EVERY_S): a hold older is a dead writer's
LAST_BYTES_PER_TOKEN = "disk_bytes_per_token"  # the supervisor's last figure, measured or estimated
LAST_RESERVE = "disk_reserve_bytes"  # the reserve the supervisor's last check kept
LAST_CHECK = ("disk_projected_bytes", LAST_BYTES_PER_TOKEN, "disk_free_bytes", LAST_RESERVE, "disk_checked_at")


class DiskPaused(DraftlineError):
    """A run stayed paused for disk space longer than its job may wait."""

    permanent = False


class _DiskSettings(Protocol):
    """What ``supervise_disk`` reads from the controller's settings."""

    data: Path
    disk_reserve_bytes: int
    disk_reserve_fraction: float
    model_dir: Path | None


@dataclass(frozen=True)
class Headroom:
    """One assessment of a run's disk needs against its volume."""

    free_bytes: int
    projected_bytes: int  # hidden-state bytes the run still needs; 0 when nothing to project from yet
    reserve_bytes: int
    bytes_per_token: float | None
    ok: bool
    message: str
    remaining_samples: int = 0
    measured: bool = False  # True once the numbers come from landed samples rather than the estimate
    replies_bytes: int = 0  # of projected_bytes: the replies still to generate
    training_bytes: int = 0  # of projected_bytes: the checkpoints and export still to write

    @property
    def hidden_bytes(self) -> int:
        return self.projected_bytes - self.replies_bytes - self.training_bytes


# ---- the volume --------------------------------------------------------------------------------


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest existing parent: a volume not yet created is measured where it would live."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def volume_usage(path: Path) -> tuple[int, int]:
    """``(free, total)`` bytes of the file system holding ``path`` (free as an unprivileged writer sees it)."""
    usage = shutil.disk_usage(existing_ancestor(path))
    return usage.free, usage.total


def reserve_for(total: int, reserve_bytes: int, reserve_fraction: float) -> int:
    """Bytes kept free: the larger of a fixed amount and a fraction of the volume."""
    return max(int(reserve_bytes), int(reserve_fraction * total))


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# ---- the estimate before any sample lands -------------------------------------------------------


def hidden_bytes_per_token(hidden_size: int, dtype: str | None = None, storage: str = "target") -> int:
    """Bytes one token costs in a hidden-state file of a target with ``hidden_size`` in ``dtype``, its
    states stored as ``storage`` (a run's ``extraction.storage``) says."""
    if storage == "fp8":
        return HIDDEN_TENSORS_PER_TOKEN * (hidden_size + FP8_SCALE_BYTES) + TOKEN_OVERHEAD_BYTES
    width = DTYPE_BYTES.get(dtype or "", DEFAULT_DTYPE_BYTES)
    return HIDDEN_TENSORS_PER_TOKEN * hidden_size * width + TOKEN_OVERHEAD_BYTES


def target_bytes_per_token(model_dir: Path, storage: str = "target") -> int | None:
    """The estimate from a target's ``config.json`` (hidden size, dtype); None when it cannot be read."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or config
    hidden = text.get("hidden_size") or config.get("hidden_size")
    if not isinstance(hidden, int):
        return None
    return hidden_bytes_per_token(hidden, str(config.get("torch_dtype") or config.get("dtype") or ""), storage)


def estimate_sample_tokens(prompt_bytes_per_row: float, max_tokens: int, max_length: int) -> float:
    """Tokens of one sample before any is measured (the rule in the module docstring)."""
    return float(min(prompt_bytes_per_row / BYTES_PER_PROMPT_TOKEN + max_tokens, max_length))


# ---- tallies -------------------------------------------------------------------------------------


def landed_counts(nbytes: int, tokens: int) -> dict[str, float]:
    """The meta counts of one verified hidden-state file, its bytes and its tokens: what the extractor hands to
    ``RunState.mark_done(landed=...)``, which adds them in the same atomic step as the sample's done bit."""
    return {HIDDEN_BYTES: nbytes, HIDDEN_TOKENS: tokens}


def _number(meta: dict[str, str], key: str) -> float:
    try:
        return float(meta.get(key, 0) or 0)
    except ValueError:
        return 0.0


def remaining_samples(state: RunState, expected: int) -> int:
    """Samples that may still get a hidden-state file: expected less those settled either way."""
    settled = state.counts(Stage.GENERATE).unverified + state.counts(Stage.EXTRACT).settled
    return max(expected - settled, 0)


# ---- the assessment ------------------------------------------------------------------------------


def assess(
    state: RunState,
    *,
    reserve_bytes: int = 0,
    reserve_fraction: float = 0.0,
    bytes_per_token_hint: float | None = None,
    target_config: dict | None = None,
) -> Headroom:
    """Project what the run still writes on its volume (hidden states, replies, checkpoints and export) and
    compare it with free space less the reserve."""
    data, run = state.paths.data, state.run
    meta = state.meta()
    free, total = volume_usage(data)
    reserve = reserve_for(total, reserve_bytes, reserve_fraction)
    expected = int(_number(meta, "expected"))
    remaining = remaining_samples(state, expected)
    landed_bytes, landed_tokens = _number(meta, HIDDEN_BYTES), _number(meta, HIDDEN_TOKENS)
    done = state.counts(Stage.EXTRACT).done
    measured = landed_tokens > 0 and done > 0
    spec = _spec(data, run)
    rows = max(expected, 1)
    if measured:
        per_token, per_sample = landed_bytes / landed_tokens, landed_tokens / done
    else:
        per_token = _number(meta, BYTES_PER_TOKEN_ESTIMATE) or bytes_per_token_hint
        per_sample = (estimate_sample_tokens(_number(meta, "prompts_bytes") / rows, spec.generation.max_tokens,
                                             spec.extraction.max_length) if spec else None)
    hidden = int(remaining * per_sample * per_token) if per_token and per_sample else 0
    if spec is not None and spec.online.enabled and spec.online.budget_bytes is not None:
        # Its files come and go every epoch; what they may still grow by is what the budget leaves.
        hidden = max(0, spec.online.budget_bytes - int(landed_bytes))
    replies = training = 0
    if spec is not None:
        generate = state.counts(Stage.GENERATE)
        replies = reply_bytes(max(expected - generate.settled, 0), _number(meta, "generated_bytes"), generate.done,
                              prompt_bytes_per_row=_number(meta, "prompts_bytes") / rows,
                              max_tokens=spec.generation.max_tokens)
        training = training_bytes(state.paths, target_config, spec.train)
    return _verdict(data, free, reserve, Rest(hidden, replies, training), per_token or None, remaining, measured)


def _spec(data: Path, run: str) -> RunSpec | None:
    try:
        return cached_spec(data, run)  # read again only when run.json changes: the supervisor asks every round
    except (RunNotFound, OSError, ValueError):
        return None


@dataclass(frozen=True)
class Rest:
    """What the run still writes, by writer."""

    hidden: int
    replies: int = 0
    training: int = 0  # checkpoints and the export

    @property
    def total(self) -> int:
        return self.hidden + self.replies + self.training

    def describe(self) -> str:
        parts = [f"{format_bytes(self.replies)} of replies" if self.replies else "",
                 f"{format_bytes(self.training)} of checkpoints and export" if self.training else ""]
        extra = ", ".join(p for p in parts if p)
        return f" (with {extra})" if extra else ""


def _verdict(data: Path, free: int, reserve: int, rest: Rest, per_token: float | None,
             remaining: int, measured: bool) -> Headroom:
    projected = rest.total
    basis = "measured" if measured else "estimated"
    rate = f"{per_token:,.0f} bytes/token {basis}" if per_token else "no size per token known yet"
    facts = (f"{format_bytes(projected)} still needed{rest.describe()}: {format_bytes(rest.hidden)} of hidden "
             f"states for {remaining:,} samples ({rate}); {format_bytes(free)} free on {data}, "
             f"{format_bytes(reserve)} kept in reserve")
    if free < reserve:
        message = (f"the volume {data} has {format_bytes(free)} free, less than the "
                   f"{format_bytes(reserve)} reserve; free space on it or grow it (or lower "
                   f"DRAFTLINE_DISK_RESERVE_BYTES / DRAFTLINE_DISK_RESERVE_FRACTION)")
        ok = False
    elif projected > free - reserve and measured:
        message = (f"{facts}; short by {format_bytes(projected - (free - reserve))}: free space "
                   f"on {data} or grow the volume, and the run resumes by itself")
        ok = False
    elif projected > free - reserve:
        message = (f"{facts}; the estimate is short by {format_bytes(projected - (free - reserve))}, "
                   "the run pauses if the sizes measured as samples land agree")
        ok = True
    else:
        message = facts
        ok = True
    return Headroom(free, projected, reserve, per_token, ok, message, remaining, measured,
                    replies_bytes=rest.replies, training_bytes=rest.training)


# ---- the pause flag ------------------------------------------------------------------------------


def _s(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def set_paused(conn: redis.Redis, run: str, reason: str, *, need: int | None = None) -> None:
    """Pause the run's extraction for lack of disk space (the first pause time is kept); ``need`` is the bytes a
    refused claim waits for (``runtime.disk_claims``)."""
    key = RunKeys(run).meta
    pipe = conn.pipeline()
    pipe.hset(key, PAUSED, reason)
    if need is not None:
        pipe.hset(key, PAUSED_NEED, str(need))
    pipe.hsetnx(key, PAUSED_AT, str(time.time()))
    pipe.execute()


def clear_paused(conn: redis.Redis, run: str) -> None:
    conn.hdel(RunKeys(run).meta, PAUSED, PAUSED_AT, PAUSED_NEED)


def claimed_bytes(conn: redis.Redis, run: str) -> int:
    """Bytes extractions of the run have claimed and are writing now."""
    return sum(int(v) for v in conn.hvals(RunKeys(run).disk_claims))


def drop_settled_claims(state: RunState) -> None:
    """Forget the claims of samples already extracted: a worker killed mid-write leaves its claim behind
    until the sample is extracted again (which claims the same field anew)."""
    key = RunKeys(state.run).disk_claims
    stale = [field for field in state.conn.hkeys(key) if state.is_done(Stage.EXTRACT, int(field))]
    if stale:
        state.conn.hdel(key, *stale)


def claim_need_fits(conn: redis.Redis, run: str, headroom: Headroom) -> bool:
    """Whether the bytes a refused claim recorded fit now beside the claims being written."""
    need = _s(conn.hget(RunKeys(run).meta, PAUSED_NEED))
    if need is None:
        return True
    return int(need) <= headroom.free_bytes - headroom.reserve_bytes - claimed_bytes(conn, run)


def paused_reason(conn: redis.Redis, run: str) -> str | None:
    """Why the run is paused for disk space, or None when it is not."""
    return _s(conn.hget(RunKeys(run).meta, PAUSED))


def wait_for_headroom(
    conn: redis.Redis,
    data: Path,
    run: str,
    *,
    poll_s: float = 2.0,
    timeout_s: float | None = None,
    log_every_s: float = WAIT_LOG_EVERY_S,
) -> None:
    """Block while the run is paused for disk space, logging once a minute what it waits for.

    Returns at once when the run is not paused. With ``timeout_s``, raises DiskPaused after waiting that
    long, so a job can end before its queue's own timeout kills it; once the worker is told to stop, raises
    ``JobYielded`` within ``poll_s`` (``runtime.shutdown``), leaving the sample to the requeued job."""
    started = time.monotonic()
    logged_at: float | None = None
    while (reason := paused_reason(conn, run)) is not None:
        shutdown.check(f"waiting for disk space for run {run}'s extraction")
        waited = time.monotonic() - started
        if logged_at is None or time.monotonic() - logged_at >= log_every_s:
            free, _ = volume_usage(data)
            log.warning("run %s: extraction waits for disk space (%.0fs so far, %s free on %s): %s",
                        run, waited, format_bytes(free), data, reason)
            logged_at = time.monotonic()
        if timeout_s is not None and waited >= timeout_s:
            raise DiskPaused(f"run {run}: still paused for disk space after {waited:.0f}s: {reason}")
        shutdown.wait(poll_s)
    if logged_at is not None:
        log.info("run %s: disk space is back after %.0fs; extraction continues", run, time.monotonic() - started)


# ---- the supervisor's step and the status -------------------------------------------------------


def supervise_disk(settings: _DiskSettings, state: RunState) -> Headroom:
    """Assess the run; pause it when its projection does not fit, un-pause it when it does again."""
    conn, run = state.conn, state.run
    drop_settled_claims(state)
    hint = target_bytes_per_token(settings.model_dir) if settings.model_dir else None
    headroom = assess(state, reserve_bytes=settings.disk_reserve_bytes,
                      reserve_fraction=settings.disk_reserve_fraction, bytes_per_token_hint=hint,
                      target_config=target_config(settings.model_dir))
    values = (headroom.projected_bytes, headroom.bytes_per_token or "", headroom.free_bytes,
              headroom.reserve_bytes, time.time())
    conn.hset(RunKeys(run).meta, mapping={k: str(v) for k, v in zip(LAST_CHECK, values)})
    was_paused = paused_reason(conn, run) is not None
    if not headroom.ok:
        set_paused(conn, run, headroom.message)
        if not was_paused:
            log.warning("run %s: %s; extraction paused", run, headroom.message)
    elif was_paused and not claim_need_fits(conn, run, headroom):
        headroom = dataclasses.replace(headroom, ok=False, message=paused_reason(conn, run) or headroom.message)
    elif was_paused:
        clear_paused(conn, run)
        log.info("run %s: %s; extraction resumes", run, headroom.message)
    return headroom


def held_field(stage: Stage) -> str:
    return f"{HELD_PREFIX}{Stage(stage)}"


class StageHold:
    """A writer of whole-run ``stage`` (training's checkpoints, the export, the evaluation's report) waiting for
    disk space, named in the run's meta so status shows the stage held and why. Best effort: a writer that
    cannot reach Redis still waits, and says so in its log."""

    def __init__(self, conn: redis.Redis, run: str, stage: Stage) -> None:
        self.conn, self.run, self.field = conn, run, held_field(stage)

    def hold(self, reason: str) -> None:
        try:
            self.conn.hset(RunKeys(self.run).meta, self.field, json.dumps({"reason": reason, "at": time.time()}))
        except redis.RedisError as exc:
            log.warning("run %s: could not record the wait for disk space in Redis: %s", self.run, exc)

    def release(self) -> None:
        try:
            self.conn.hdel(RunKeys(self.run).meta, self.field)
        except redis.RedisError as exc:
            log.warning("run %s: could not clear the wait for disk space in Redis: %s", self.run, exc)


def _live_hold(value: str | None) -> str | None:
    """The reason of a hold its writer renewed lately (a waiting writer renews it at every try, at least once a
    minute), else None: a writer killed while it waited leaves a hold nobody releases."""
    try:
        hold = json.loads(value) if value else None
        return hold["reason"] if hold and time.time() - float(hold["at"]) <= HOLD_STALE_S else None
    except (ValueError, TypeError, KeyError):
        return None


def release_stages(conn: redis.Redis, run: str, stages: tuple[Stage, ...] = WRITER_HOLDS) -> None:
    """Forget holds a killed writer left: a job of those stages starting again holds anew if it must."""
    conn.hdel(RunKeys(run).meta, *(held_field(stage) for stage in stages))


def disk_status(conn: redis.Redis, run: str) -> dict:
    """The pause, the writers holding for space, and the last projection, from the run's meta only (cheap at
    any run size)."""
    writers = tuple(held_field(stage) for stage in WRITER_HOLDS)
    fields = (PAUSED, PAUSED_AT, HIDDEN_BYTES, HIDDEN_TOKENS, *LAST_CHECK, *writers)
    meta = dict(zip(fields, (_s(v) for v in conn.hmget(RunKeys(run).meta, fields))))
    held = {str(stage): reason for stage in WRITER_HOLDS if (reason := _live_hold(meta[held_field(stage)]))}
    landed_bytes, landed_tokens = _number(meta, HIDDEN_BYTES), _number(meta, HIDDEN_TOKENS)
    if landed_tokens > 0:
        per_token: float | None = landed_bytes / landed_tokens
    else:
        per_token = _number(meta, LAST_BYTES_PER_TOKEN) or None
    paused = meta[PAUSED] is not None
    return {
        "paused": paused,
        # A paused run takes no new prompts (the supervisor stops feeding) and its extractions wait; a writer
        # that found the volume full holds its own stage.
        "holds": list(dict.fromkeys([*(PAUSE_HOLDS if paused else ()), *held])),
        "held": held,  # stage -> why its writer waits
        "reason": meta[PAUSED],
        "paused_at": _number(meta, PAUSED_AT) or None,
        "projected_bytes": int(_number(meta, "disk_projected_bytes")) if meta["disk_checked_at"] else None,
        # What that projection was held against: the free space at the check and the reserve kept.
        "checked_free_bytes": int(_number(meta, "disk_free_bytes")) if meta["disk_checked_at"] else None,
        "reserve_bytes": int(_number(meta, LAST_RESERVE)) if meta["disk_checked_at"] else None,
        "bytes_per_token": round(per_token, 1) if per_token else None,
        "checked_at": _number(meta, "disk_checked_at") or None,
    }


def format_disk_pause(disk: dict) -> str | None:
    """The operator lines for a run paused or held for disk space (``disk`` holds ``disk_status``'s keys), else
    None."""
    lines = [f"  PAUSED    {stage} waits for disk space: {reason}" for stage, reason in (disk.get("held") or {}).items()]
    if disk.get("paused"):
        lines.insert(0, f"  PAUSED    new prompts held back and extraction waits for disk space: {disk.get('reason')}")
    return "\n".join(lines) or None
