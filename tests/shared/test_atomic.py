import json
import os
from pathlib import Path

import pytest

from shared.atomic import atomic_write, atomic_write_json, temp_files


def test_write_publishes_complete_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "a" / "b.json"
    atomic_write_json(target, {"x": 1})
    assert json.loads(target.read_text()) == {"x": 1}
    assert temp_files(tmp_path) == []


def test_failed_write_keeps_the_old_file_and_removes_the_temp(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def broken(handle):
        handle.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, broken)
    assert target.read_bytes() == b"old"
    assert temp_files(tmp_path) == []


def test_temp_files_are_found(tmp_path):
    (tmp_path / "x").mkdir()
    leftover = tmp_path / "x" / ".tmp-foo.safetensors.abc"
    leftover.write_bytes(b"")
    assert temp_files(tmp_path) == [leftover]
    assert os.path.exists(leftover)


# ---- durability: each step of atomic_write, observed on the real calls ---------------------------
# Spies wrap the real os.fsync and os.replace (and still call them); each fsync'd descriptor is
# resolved to its path through /proc/self/fd, with the file's size at that moment.

@pytest.fixture()
def calls(monkeypatch) -> list[tuple]:
    """("fsync", path, size) and ("replace", src, dst), in the order they happened."""
    seen: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        seen.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")), os.fstat(fd).st_size))
        return real_fsync(fd)

    def replace(src, dst, **kwargs):
        seen.append(("replace", Path(src), Path(dst)))
        return real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return seen


def only_replace(calls: list[tuple]) -> tuple[int, Path, Path]:
    replaces = [(i, c[1], c[2]) for i, c in enumerate(calls) if c[0] == "replace"]
    assert len(replaces) == 1, calls
    return replaces[0]


def test_the_temp_files_complete_data_is_fsynced_before_the_rename(tmp_path, calls):
    data = b"x" * 100  # less than Python's write buffer holds: unflushed, it would not be in the file yet
    atomic_write(tmp_path / "f.bin", lambda handle: handle.write(data))
    at, temp, final = only_replace(calls)
    assert final == tmp_path / "f.bin" and temp.parent == tmp_path and temp.name.startswith(".tmp-f.bin.")
    synced = [i for i, c in enumerate(calls) if c[0] == "fsync" and c[1] == temp]
    assert synced and synced[-1] < at, calls
    assert calls[synced[-1]][2] == len(data)  # flushed to the file before the fsync, not after


def test_the_final_path_shows_the_old_file_while_the_new_one_is_written_then_the_whole_new_one(tmp_path, calls):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    seen_mid_write = []

    def writer(handle):
        handle.write(b"new, first half; ")
        handle.flush()
        seen_mid_write.append(target.read_bytes())
        handle.write(b"second half")

    atomic_write(target, writer)
    assert seen_mid_write == [b"old"]
    assert target.read_bytes() == b"new, first half; second half"
    _, temp, final = only_replace(calls)
    assert final == target and not temp.exists() and temp_files(tmp_path) == []


def test_the_directory_is_fsynced_after_the_rename(tmp_path, calls):
    atomic_write_json(tmp_path / "sub" / "f.json", {"x": 1})
    at, _, final = only_replace(calls)
    dir_syncs = [i for i, c in enumerate(calls) if c[0] == "fsync" and c[1] == final.parent]
    assert dir_syncs and dir_syncs[-1] > at, calls
