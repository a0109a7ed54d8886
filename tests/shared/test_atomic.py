import json
import os

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
