"""The tiny target, built once per version of what goes into it and kept across test runs.

Building it trains a model for half a minute on an idle 2-core machine, far longer on a loaded one; a
per-run build behind a session fixture turned one slow machine into hundreds of timed-out tests. The
cache key hashes everything the build reads (``tiny_model.py``, the shipped prompts it trains on, the
library versions), so a change to any of them builds a new entry.

An entry is built in a temp directory and renamed into place, so a reader never sees half of one; a
lock keeps two concurrent test runs from building the same entry twice; a manifest of sha256 digests,
written last, is checked on every load, so a torn or modified entry is rebuilt, never used.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

from shared.atomic import TEMP_PREFIX, atomic_write_json, fsync_dir, read_json
from tests.support.processes import REPO

log = logging.getLogger(__name__)

CACHE_ENV = "DRAFTLINE_TEST_CACHE"
MODEL_NAME = "tiny"  # the directory's name is the served model name the tests expect
MANIFEST = "manifest.json"
KEY_SOURCES = (REPO / "services" / "cli" / "tiny_model.py", REPO / "shared" / "data" / "demo_prompts.jsonl")
KEY_LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors")


class TinyTargetCacheError(RuntimeError):
    """A cache entry that a test changed while it was in use."""


def cache_root() -> Path:
    """``$DRAFTLINE_TEST_CACHE``, else ``$XDG_CACHE_HOME/draftline``, else ``~/.cache/draftline``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "draftline"


def cache_key() -> str:
    digest = hashlib.sha256()
    for path in KEY_SOURCES:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for name in KEY_LIBRARIES:
        digest.update(f"{name}=={metadata.version(name)}\0".encode())
    return digest.hexdigest()[:20]


def digests(model_dir: Path) -> dict[str, str]:
    """sha256 of every file under ``model_dir``, by path relative to it."""
    return {str(p.relative_to(model_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(model_dir.rglob("*")) if p.is_file()}


def is_intact(entry: Path, model_name: str = MODEL_NAME) -> bool:
    """The entry's model directory holds exactly the files its manifest names, with those contents."""
    try:
        manifest = read_json(entry / MANIFEST)
    except (OSError, ValueError):
        return False
    model_dir = entry / model_name
    return model_dir.is_dir() and "config.json" in manifest and digests(model_dir) == manifest


def verify_unchanged(model_dir: Path) -> None:
    """Raise if a test wrote into a shared cached model (tests copy it before changing anything)."""
    if not is_intact(model_dir.parent, model_dir.name):
        raise TinyTargetCacheError(f"{model_dir} changed during the test session: a test wrote into the shared "
                                   "tiny target (or another cached test model) instead of into a copy of it")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the handle closes
        yield


def _build(root: Path, entry: Path, model_name: str, make: Callable[[Path], Path]) -> None:
    tmp = root / f"{TEMP_PREFIX}{entry.name}.{uuid.uuid4().hex[:8]}"
    try:
        model_dir = make(tmp / model_name)
        for path in model_dir.iterdir():  # save_pretrained does not fsync; the rename must publish whole files
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        atomic_write_json(tmp / MANIFEST, digests(model_dir))
        os.rename(tmp, entry)
        fsync_dir(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def entry_for(root: Path | None = None) -> Path:
    """Where this key's entry lives (built or not)."""
    return (Path(root) if root is not None else cache_root()) / f"tiny-target-{cache_key()}"


def cached_model(entry: Path, model_name: str, make: Callable[[Path], Path]) -> Path:
    """``entry / model_name``, built first by ``make(directory)`` if no intact entry exists: in a temp
    directory, under a lock, renamed into place, with a manifest checked on every load. The tiny target
    and the engine tests' targets (tests/engines) are all cached this way."""
    root = entry.parent
    root.mkdir(parents=True, exist_ok=True)
    if is_intact(entry, model_name):
        return entry / model_name
    with _locked(root / f"{entry.name}.lock"):
        if is_intact(entry, model_name):  # another test run built it while this one waited for the lock
            return entry / model_name
        if entry.exists():
            log.warning("test model cache %s is incomplete or changed: rebuilding it", entry)
            broken = root / f"{TEMP_PREFIX}{entry.name}.broken.{uuid.uuid4().hex[:8]}"
            os.rename(entry, broken)
            shutil.rmtree(broken, ignore_errors=True)
        for stale in root.glob(f"{TEMP_PREFIX}{entry.name}.*"):  # a build killed midway, under this lock
            shutil.rmtree(stale, ignore_errors=True)
        _build(root, entry, model_name, make)
    return entry / model_name


def cached_tiny_model(root: Path | None = None) -> Path:
    """The tiny target's directory in the cache, built first if no intact entry exists for this key."""
    from services.cli.tiny_model import make_tiny_model

    return cached_model(entry_for(root), MODEL_NAME, make_tiny_model)
