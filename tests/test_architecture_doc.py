"""docs/architecture.md matches the tree: every file or folder it names exists, and every module of the product
is named in the section of its room (a heading naming its folder, ``### `modeling/```).

A name with a slash is a path from the repository root or from ``services/``; a bare file name
(``train.py``) must exist somewhere in the source folders. A move that forgets the map fails here, and so
does a new module nobody placed.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
NAME = re.compile(r"`([A-Za-z0-9_./<>-]+)`")
SOURCE_FOLDERS = ("shared", "runtime", "modeling", "evaluation", "services")
ROOM = re.compile(r"^### `([A-Za-z0-9_./-]+)/`\s*$", re.M)


def named_paths(text: str) -> list[str]:
    """Backticked names that look like files or folders (a suffix or a slash), placeholders left out."""
    found = []
    for token in NAME.findall(text):
        if "<" in token or token.startswith(("../", "/")) or "=" in token:  # a placeholder, outside, a route
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


def rooms(text: str) -> dict[str, set[str]]:
    """Folder -> the ``.py`` names its section of the map names (a section runs to the next heading)."""
    found = {}
    marks = list(ROOM.finditer(text))
    for mark, after in zip(marks, [*marks[1:], None]):
        section = text[mark.end():after.start() if after else len(text)].split("\n## ", 1)[0]
        found[mark.group(1)] = {name for name in NAME.findall(section) if name.endswith(".py") and "/" not in name}
    return found


def modules_by_folder() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for folder in SOURCE_FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            if path.name != "__init__.py":
                found.setdefault(path.parent.relative_to(REPO).as_posix(), set()).add(path.name)
    return found


def test_every_module_is_named_in_its_rooms_section_and_every_name_there_is_in_that_room():
    named, actual = rooms(DOC.read_text(encoding="utf-8")), modules_by_folder()
    assert sorted(set(actual) - set(named)) == []  # a folder of modules without a section
    unplaced = {folder: sorted(actual[folder] - named[folder]) for folder in actual if actual[folder] - named[folder]}
    assert unplaced == {}
    strays = {folder: sorted(named[folder] - actual.get(folder, set())) for folder in named
              if named[folder] - actual.get(folder, set())}
    assert strays == {}


def test_the_room_check_sees_an_unplaced_module():
    text = "### `shared/`\n\n- `lifecycle.py`: x\n\n### `runtime/`\n\n- `worker.py`: y\n"
    assert rooms(text) == {"shared": {"lifecycle.py"}, "runtime": {"worker.py"}}
