"""The data volume's identity: proof that a worker writes where the controller reads.

Workers on other hosts reach the volume through their own mount (NFS, Lustre, CephFS, …). A missing or
wrong mount leaves an empty local directory in its place, and a worker writing there produces replies
and hidden-state files that nobody reads. So the controller owns an identity for its volume:

- ``<data>/volume.json`` holds a random id, created once, never overwritten (written atomically and
  published with ``link``, which refuses an existing name, also on NFS);
- the controller records that id in Redis (``VOLUME_KEY``) at start-up and again every few seconds,
  so a flushed Redis learns it back;
- a worker compares its own ``<data>/volume.json`` with Redis's id when it starts and before every job
  it takes, and refuses with ``VolumeMismatch`` when they differ or its file is missing.

Redis without a recorded id (no controller has run against it yet) refuses nothing: there is no volume
to differ from, and the check before each job picks the id up as soon as a controller records one.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import redis

from shared.atomic import TEMP_PREFIX, atomic_write_json, fsync_dir, read_json
from shared.errors import DraftlineError
from runtime.runstate import PREFIX

log = logging.getLogger(__name__)

IDENTITY_FILE = "volume.json"
VOLUME_KEY = f"{PREFIX}:volume_id"
# The controller records its id this often, so a flushed Redis knows it again within seconds.
RECLAIM_INTERVAL_S = 5.0


class VolumeMismatch(DraftlineError):
    """This process's data directory is not the volume the controller uses (or it cannot be read)."""


@dataclass(frozen=True)
class VolumeIdentity:
    volume_id: str
    created_at: float
    created_on: str

    @classmethod
    def new(cls) -> VolumeIdentity:
        return cls(volume_id=uuid.uuid4().hex, created_at=time.time(), created_on=socket.gethostname())


def identity_path(data: Path) -> Path:
    return Path(data) / IDENTITY_FILE


def read_identity(data: Path) -> VolumeIdentity | None:
    """The identity written at ``data``'s root; None when there is none. A file that is there but
    cannot be read or parsed raises VolumeMismatch: it is not safe to guess what volume this is."""
    path = identity_path(data)
    try:
        raw = read_json(path)
        return VolumeIdentity(volume_id=str(raw["volume_id"]), created_at=float(raw["created_at"]),
                              created_on=str(raw["created_on"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise VolumeMismatch(f"{path}: unreadable volume identity ({type(exc).__name__}: {exc})") from None


def ensure_identity(data: Path) -> VolumeIdentity:
    """The volume's identity, created if the volume has none. Never replaces an existing one: two
    creators racing both end up with whichever identity was published first."""
    found = read_identity(data)
    if found is not None:
        return found
    data = Path(data)
    data.mkdir(parents=True, exist_ok=True)
    identity = VolumeIdentity.new()
    staging = data / f"{TEMP_PREFIX}{IDENTITY_FILE}.{identity.volume_id}"
    atomic_write_json(staging, asdict(identity))
    try:
        os.link(staging, identity_path(data))  # fails if the name exists: the first identity stays
        fsync_dir(data)
        log.info("volume %s: new identity %s", data, identity.volume_id)
    except FileExistsError:
        pass
    finally:
        staging.unlink(missing_ok=True)
    return read_identity(data) or identity


def claim_volume(data: Path, conn: redis.Redis) -> VolumeIdentity:
    """Record ``data``'s identity in Redis as the volume every worker must see (the controller's job)."""
    identity = ensure_identity(data)
    previous = conn.set(VOLUME_KEY, identity.volume_id, get=True)
    if previous is not None and previous.decode() != identity.volume_id:
        log.warning("redis recorded volume %s, but this controller's data directory %s is volume %s; "
                    "workers still on the other volume now refuse jobs", previous.decode(),
                    Path(data).resolve(), identity.volume_id)
    return identity


def try_claim(data: Path, conn: redis.Redis) -> VolumeIdentity | None:
    """``claim_volume``, logging instead of raising: Redis or the volume may be back next round, and the
    controller's API (its preflight) reports them meanwhile."""
    try:
        return claim_volume(data, conn)
    except (redis.RedisError, OSError, VolumeMismatch) as exc:
        log.warning("volume identity of %s not recorded in redis: %s", data, exc)
        return None


def keep_claimed(data: Path, conn: redis.Redis, stop: threading.Event,
                 interval_s: float = RECLAIM_INTERVAL_S) -> None:
    """Record the identity every ``interval_s`` until ``stop`` is set (a flushed Redis forgets it)."""
    while not stop.wait(interval_s):
        try_claim(data, conn)


def claimed_id(conn: redis.Redis) -> str | None:
    value = conn.get(VOLUME_KEY)
    return value.decode() if value is not None else None


def verify_volume(data: Path, conn: redis.Redis) -> str | None:
    """Raise VolumeMismatch unless ``data`` is the volume the controller recorded in Redis.

    Returns the verified id, or None when no controller has recorded one yet."""
    expected = claimed_id(conn)
    if expected is None:
        return None
    where = Path(data).resolve()
    found = read_identity(data)
    if found is None:
        raise VolumeMismatch(
            f"DRAFTLINE_DATA={data} ({where}) has no {IDENTITY_FILE}, so it is not the volume the controller "
            f"uses (volume {expected}). Mount the controller's shared filesystem at this path, or point "
            f"DRAFTLINE_DATA at its mount point; this worker takes no jobs until then.")
    if found.volume_id != expected:
        raise VolumeMismatch(
            f"DRAFTLINE_DATA={data} ({where}) is volume {found.volume_id} (created on {found.created_on}), "
            f"but the controller uses volume {expected}. Mount the controller's shared filesystem at this "
            f"path; this worker takes no jobs until then.")
    return expected
