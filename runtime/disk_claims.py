"""An extraction's claim on the volume: the bytes of its hidden-state file, granted before the file is written.

The supervisor's projection (``runtime.disk``) pauses a run between its rounds; a round can be seconds on a
loaded machine, and extractions write a file in milliseconds, so that check alone lets a volume fill up
between two rounds. Each extraction therefore claims its own file's size first:

    claim = tokens of the sample × bytes per token (measured from landed files, else the supervisor's
            last figure, else the estimate recorded at submission)

A Lua script grants the claim atomically across every extractor of every host, and only while

    claim + claims being written by others <= free space on the volume - the reserve

(the reserve is the one the supervisor last checked against, kept in the run's meta). A refused claim
pauses the run with what it needs; the extraction waits in ``wait_for_headroom`` like any paused sample,
and the supervisor lifts the pause once the need fits again (``disk.claim_need_fits``). A claim is
dropped when its write ends, either way; a worker killed mid-write leaves one that the sample's next
extraction overwrites, or that the supervisor drops once the sample is done.

An online run's claim must also fit its byte budget beside the spool's files (``runtime.spool``) and, for a sample
outside the batch the trainer waits for, beside the room the trainer keeps for that batch's missing files
(``ONLINE_RESERVE``): refused, it waits without pausing anything, its time counted as the extractors' blocked
time, for ``DEFER_AFTER_S``; then it (``BudgetDeferred``), so workers blocked on later samples never keep the one the trainer waits for (which the
budget lets past) waiting in the queue behind them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from runtime import shutdown
from runtime.disk import (BYTES_PER_TOKEN_ESTIMATE, HIDDEN_BYTES, HIDDEN_TOKENS, LAST_BYTES_PER_TOKEN, LAST_RESERVE,
                          _number, _s, format_bytes, set_paused, volume_usage, wait_for_headroom)
from runtime.spool import ONLINE_BATCH, ONLINE_BLOCKED_S, ONLINE_HEAD, ONLINE_REFUSED_AT
from shared.errors import DraftlineError
from shared.lifecycle import RunKeys

BUDGET_POLL_S = 0.5
# A claim the budget refuses this long gives its worker back (``BudgetDeferred``): the worker then takes the next
# job, which may hold the sample the trainer waits for, and the trainer asks for this one again later.
DEFER_AFTER_S = 2.0


class BudgetDeferred(DraftlineError):
    """An online run's budget holds no room for this sample now, and the trainer waits for another one."""
  # a trainer frees files at each checkpoint: a blocked extraction looks again this often

log = logging.getLogger(__name__)

# Grants ARGV[2] bytes to field ARGV[1] when they and every other field's bytes fit in ARGV[3] and, for an online
# run (ARGV[4] its budget, else -1), also fit the budget with the spool's bytes (the meta's hidden_bytes), unless
# ARGV[5] is 1 (the sample the trainer waits for); a sample outside the batch the trainer waits for (ARGV[6] is 0)
# must also leave the room the trainer keeps for that batch (the meta's online_reserve). Returns -1 when granted,
# -2 when the budget refused it, -3 when only the batch's room did, else the bytes the other claims hold.
_CLAIM = """
local others = 0
local values = redis.call('HGETALL', KEYS[1])
for i = 1, #values, 2 do
  if values[i] ~= ARGV[1] then others = others + tonumber(values[i + 1]) end
end
local need = tonumber(ARGV[2])
if others + need > tonumber(ARGV[3]) then return others end
local budget = tonumber(ARGV[4])
if budget >= 0 and ARGV[5] ~= '1' then
  local spool = tonumber(redis.call('HGET', KEYS[2], 'hidden_bytes') or '0')
  if spool + others + need > budget then return -2 end
  if ARGV[6] ~= '1' then
    local reserve = tonumber(redis.call('HGET', KEYS[2], 'online_reserve') or '0') or 0
    if spool + others + need + reserve > budget then return -3 end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return -1
"""
BUDGET_REFUSED = -2
RESERVE_REFUSED = -3  # the budget holds it, but not beside the room kept for the batch the trainer waits for


_FIELDS = (HIDDEN_BYTES, HIDDEN_TOKENS, LAST_BYTES_PER_TOKEN, BYTES_PER_TOKEN_ESTIMATE, LAST_RESERVE, ONLINE_HEAD,
           ONLINE_BATCH)


def _claim_facts(conn: redis.Redis, run: str) -> tuple[float | None, str, int, tuple[str | None, list[str]]]:
    """``(bytes per token, where that figure comes from, reserve, (the sample an online trainer waits for, the
    missing samples of its batch))`` in one read of the run's meta."""
    meta = dict(zip(_FIELDS, (_s(v) for v in conn.hmget(RunKeys(run).meta, _FIELDS))))
    reserve = int(_number(meta, LAST_RESERVE))
    waited = (meta.get(ONLINE_HEAD), (meta.get(ONLINE_BATCH) or "").split(","))
    if _number(meta, HIDDEN_TOKENS) > 0:
        return _number(meta, HIDDEN_BYTES) / _number(meta, HIDDEN_TOKENS), "measured", reserve, waited
    for field in (LAST_BYTES_PER_TOKEN, BYTES_PER_TOKEN_ESTIMATE):
        if _number(meta, field) > 0:
            return _number(meta, field), "estimated", reserve, waited
    return None, "unknown", reserve, waited


def bytes_per_token(conn: redis.Redis, run: str) -> tuple[float | None, str]:
    """The run's bytes per token and where the figure comes from; None when nothing is known yet."""
    per_token, basis, _, _ = _claim_facts(conn, run)
    return per_token, basis


@contextmanager
def claim_space(conn: redis.Redis, data: Path, run: str, sample_id: int, tokens: int,
                *, budget: int | None = None, poll_s: float = 2.0) -> Iterator[int]:
    """Hold a claim on the bytes of sample ``sample_id``'s file (``tokens`` long) while the body writes it.

    Waits, with the run paused, while the claim does not fit the disk, and (an online run, ``budget`` its byte
    budget) while it does not fit the budget beside the spool's files (``runtime.spool``); yields the bytes
    claimed (0 when no size per token is known yet, so nothing can be claimed: the supervisor's check is all
    there is then)."""
    per_token, basis, reserve, (head, batch) = _claim_facts(conn, run)
    if per_token is None:
        yield 0
        return
    need = int(tokens * per_token)
    keys = RunKeys(run)
    grant = conn.register_script(_CLAIM)
    blocked_since = None
    # Asked first: a claim that fits costs one round trip; only a refused one pauses the run and waits.
    while True:
        free, _ = volume_usage(data)
        others = int(grant(keys=[keys.disk_claims, keys.meta],
                           args=[sample_id, need, free - reserve, -1 if budget is None else budget,
                                 1 if head == str(sample_id) else 0, 1 if str(sample_id) in batch else 0]))
        if others in (BUDGET_REFUSED, RESERVE_REFUSED):
            # Not a pause: the trainer frees the spool as its checkpoints land, and the extraction goes on then.
            # A full budget is said to the trainer, which checkpoints to release what it has read; a claim that
            # only the batch's room refused says nothing: that batch's files still fit.
            if others == BUDGET_REFUSED:
                conn.hset(keys.meta, ONLINE_REFUSED_AT, time.time())
            blocked_since = blocked_since or time.monotonic()
            if time.monotonic() - blocked_since >= DEFER_AFTER_S:
                conn.hincrbyfloat(keys.meta, ONLINE_BLOCKED_S, round(time.monotonic() - blocked_since, 3))
                raise BudgetDeferred(f"sample {sample_id}: the online budget of {format_bytes(budget or 0)} is full")
            if shutdown.wait(min(poll_s, BUDGET_POLL_S)):  # told to stop: the time blocked counts, then the job yields
                conn.hincrbyfloat(keys.meta, ONLINE_BLOCKED_S, round(time.monotonic() - blocked_since, 3))
                shutdown.check(f"sample {sample_id} waited for room in the online budget")
            head, batch = _claim_facts(conn, run)[3]
            continue
        if blocked_since is not None:
            conn.hincrbyfloat(keys.meta, ONLINE_BLOCKED_S, round(time.monotonic() - blocked_since, 3))
            blocked_since = None
        if others < 0:
            break
        reason = (f"sample {sample_id} needs {format_bytes(need)} ({tokens:,} tokens at {per_token:,.0f} "
                  f"bytes/token {basis}); {format_bytes(free)} free on {data}, {format_bytes(reserve)} kept in "
                  f"reserve, {format_bytes(others)} being written by other extractions: free space on {data} "
                  f"or grow the volume, and extraction resumes by itself")
        set_paused(conn, run, reason, need=need)
        log.warning("run %s: %s; extraction paused", run, reason)
        wait_for_headroom(conn, data, run, poll_s=poll_s)
        reserve, (head, batch) = _claim_facts(conn, run)[2:]  # as the supervisor's check that lifted the pause kept it
    try:
        yield need
    finally:
        conn.hdel(keys.disk_claims, str(sample_id))
