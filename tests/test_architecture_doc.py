"""docs/architecture.md matches the tree: every file or folder it names exists.

A name with a slash is a path from the repository root or from ``services/``; a bare file name
(``train.py``) must exist somewhere in the source folders. A move that forgets the map fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
NAME = re.compile(r"`([A-Za-z0-9_./<>-]+)`")
SOURCE_FOLDERS = ("shared", "runtime", "services")


def named_paths(text: str) -> list[str]:
    """Backticked names that look like files or folders (a suffix or a slash), placeholders left out."""
    found = []
    for token in NAME.findall(text):
        if "<" in token or token.startswith("../") or "=" in token:
            continue
        if "/" in token or re.search(r"\.(py|md|yml|sh)$", token):
            found.append(token.rstrip("/"))
    return found


def exists(name: str) -> bool:
    if "/" in name:
        return (REPO / name).exists() or (REPO / "services" / name).exists()
    return any(any((REPO / folder).rglob(name)) for folder in SOURCE_FOLDERS) or (REPO / name).exists()


def test_every_path_the_architecture_map_names_exists():
    missing = [name for name in named_paths(DOC.read_text(encoding="utf-8")) if not exists(name)]
    assert missing == []


def test_the_check_sees_a_missing_path():
    assert named_paths("`runtime/worker.py` and `nowhere/gone.py` and `train.py`") == [
        "runtime/worker.py", "nowhere/gone.py", "train.py"]
    assert not exists("nowhere/gone.py") and exists("runtime/worker.py") and exists("train.py")
