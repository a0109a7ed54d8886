"""Per-shard manifests of verified hidden-state files: ``hidden_states/rows_…/manifest.jsonl``.

The extractor appends one JSON line per sample after ``verify_hidden_file`` accepts the file and before
the sample is marked done, so the volume alone says which files are finished work and what they must
look like. Several extractor processes share a shard: each append opens the file with ``O_APPEND``,
holds an exclusive ``flock``, writes the whole line in one ``write`` and fsyncs before unlocking.
A crash can still leave a torn last line; readers skip it, and the next writer starts on a fresh line.
The last entry of a sample wins (a sample that is redone gets a new entry).

Two checks against an entry: the quick one reads only the file's size and safetensors header (a
resume over terabytes must not read every byte); the deep one is the full ``verify_hidden_file``,
checksum included.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from shared import eagle3
from shared.atomic import fsync_dir
from shared.errors import HiddenStateFileError
from shared.hidden_file import HiddenFileInfo, read_header, verify_hidden_file
from shared.layout import RunPaths

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.jsonl"


@dataclass(frozen=True)
class ManifestEntry:
    """What a verified hidden-state file of one sample is: its checksum, size, tokens, dtype, layers."""

    sample_id: int
    sha256: str
    bytes: int
    num_tokens: int
    dtype: str
    layer_ids: list[int]
    at: float = 0.0
    # The file's modification time as the writer of the entry saw it: which version of a sample's file the entry
    # is for, whatever the clocks of the hosts (an online run extracts a sample again each epoch). None in entries
    # written before it was recorded.
    mtime_ns: int | None = None

    @classmethod
    def from_info(cls, sample_id: int, info: HiddenFileInfo) -> ManifestEntry:
        return cls(sample_id=sample_id, sha256=info.sha256, bytes=info.nbytes, num_tokens=info.num_tokens,
                   dtype=info.dtype, layer_ids=list(info.layer_ids), at=time.time())

    def to_line(self) -> bytes:
        return (json.dumps(asdict(self), sort_keys=True) + "\n").encode("utf-8")


def manifest_path(paths: RunPaths, sample_id: int) -> Path:
    """The manifest of the shard that holds ``sample_id``'s hidden-state file."""
    return paths.hidden(sample_id).parent / MANIFEST_NAME


# ---- writing ------------------------------------------------------------------------------------


def append_entry(path: Path, entry: ManifestEntry) -> None:
    """Append ``entry`` durably; safe with other processes appending to the same manifest."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        line = entry.to_line()
        if _ends_torn(fd):
            line = b"\n" + line  # a writer died mid-line: its fragment stays a line of its own, skipped by readers
        _write_all(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)  # closing the descriptor releases the lock
    if created:
        fsync_dir(path.parent)


def _ends_torn(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


def _write_all(fd: int, data: bytes) -> None:
    # A regular file takes the whole line in one write; the loop covers a short write on a nearly full disk.
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


# ---- reading ------------------------------------------------------------------------------------


def read_manifest(path: Path) -> dict[int, ManifestEntry]:
    """Entries by sample id, the last line of an id winning; a torn or unreadable line is skipped."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return {}
    entries: dict[int, ManifestEntry] = {}
    lines = raw.split(b"\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        entry = _parse(line)
        if entry is not None:
            entries[entry.sample_id] = entry
        elif number < len(lines):  # only the very last line may be torn by a crash; anything else is news
            log.warning("%s: line %d is not a manifest entry; skipped", path, number)
    return entries


def _parse(line: bytes) -> ManifestEntry | None:
    try:
        record = json.loads(line)
        return ManifestEntry(
            sample_id=int(record["sample_id"]), sha256=str(record["sha256"]), bytes=int(record["bytes"]),
            num_tokens=int(record["num_tokens"]), dtype=str(record["dtype"]),
            layer_ids=[int(x) for x in record["layer_ids"]], at=float(record.get("at", 0.0)),
            mtime_ns=int(record["mtime_ns"]) if record.get("mtime_ns") is not None else None,
        )
    except (ValueError, KeyError, TypeError):
        return None


# ---- checking a file against its entry ----------------------------------------------------------


def check_quick(path: Path, entry: ManifestEntry) -> None:
    """Size and header agree with ``entry``; reads the header only. Raises HiddenStateFileError."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise HiddenStateFileError(f"{path}: missing") from None
    if size != entry.bytes:
        raise HiddenStateFileError(f"{path}: {size} bytes on disk, the manifest recorded {entry.bytes}")
    header, data_start = read_header(path)
    meta = header.pop("__metadata__", {}) or {}
    try:
        tokens = header[eagle3.INPUT_IDS]["shape"]
        dtype = header[eagle3.LAST_HIDDEN]["dtype"]
        end = max(info["data_offsets"][1] for info in header.values())
        layer_ids = json.loads(meta.get(eagle3.META_LAYER_IDS, "null"))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise HiddenStateFileError(f"{path}: header lacks what a hidden-state file holds ({exc!r})") from None
    found = {"num_tokens": tokens, "dtype": dtype, "layer_ids": layer_ids, "bytes": data_start + end}
    wanted = {"num_tokens": [entry.num_tokens], "dtype": entry.dtype, "layer_ids": entry.layer_ids, "bytes": size}
    for key, value in wanted.items():
        if found[key] != value:
            raise HiddenStateFileError(f"{path}: header says {key} {found[key]!r}, the manifest recorded {value!r}")


def check_deep(path: Path, entry: ManifestEntry) -> HiddenFileInfo:
    """The full verification against ``entry``: every value finite and the checksum equal."""
    info = verify_hidden_file(path, layer_ids=entry.layer_ids, dtype=entry.dtype, sha256=entry.sha256)
    if info.num_tokens != entry.num_tokens:
        raise HiddenStateFileError(f"{path}: {info.num_tokens} tokens, the manifest recorded {entry.num_tokens}")
    return info


def check_entry(path: Path, entry: ManifestEntry, *, deep: bool) -> None:
    if deep:
        check_deep(path, entry)
    else:
        check_quick(path, entry)
