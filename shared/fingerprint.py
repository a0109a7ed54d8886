"""The target's fingerprint, torch-free so light services (controller, extractor) can compute it too."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def model_fingerprint(model_dir: Path) -> str:
    """sha256 of the canonical JSON of ``config.json``: key order and whitespace never change it."""
    with open(Path(model_dir) / "config.json", encoding="utf-8") as handle:
        config = json.load(handle)
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
