"""SmolLM2 converted from its shipped GGUF once per machine and kept across test runs.

The conversion takes half a minute or more on a busy 2-core machine; a per-test conversion would make
the target tests the slowest in the suite. The entry goes through the real ``ensure_target`` (its lock,
temp directory and marker), in a folder keyed by the GGUF's pinned sha256 and the versions of the
libraries that convert it, so a new source or a new converter makes a new entry.
"""

from __future__ import annotations

import hashlib
from importlib import metadata
from pathlib import Path

from shared.targets import SMOLLM2, files_unchanged
from tests.support.tiny_target import cache_root

CONVERTER_LIBRARIES = ("torch", "transformers", "gguf")


class SmolLM2CacheError(RuntimeError):
    """The cached conversion changed while the test session used it."""


def cache_key() -> str:
    versions = "".join(f"{name}=={metadata.version(name)}\0" for name in CONVERTER_LIBRARIES)
    return f"{SMOLLM2.sha256[:16]}-{hashlib.sha256(versions.encode()).hexdigest()[:8]}"


def entry_dir(root: Path | None = None) -> Path:
    """Where this key's converted directory lives; its name is the served model name, ``smollm2``."""
    return (Path(root) if root is not None else cache_root()) / f"smollm2-{cache_key()}" / SMOLLM2.name


def cached_smollm2(root: Path | None = None) -> Path:
    from services.cli.target_build import ensure_target

    return ensure_target(SMOLLM2.name, entry_dir(root))


def verify_unchanged(model_dir: Path) -> None:
    """Raise if a test wrote into the shared conversion (tests copy it before changing anything)."""
    if not files_unchanged(model_dir):
        raise SmolLM2CacheError(f"{model_dir} changed during the test session: a test wrote into the shared "
                                "SmolLM2 conversion instead of into a copy of it")
