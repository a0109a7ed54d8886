"""Writes that find the volume full wait for space (runtime.space): on a real size-limited tmpfs filled by another
writer, with the run's stage held in real Redis while they wait."""

from __future__ import annotations

import errno
import threading
import time

import pytest

from runtime.disk import StageHold, disk_status
from runtime.space import append_line, no_space, write_with_space
from shared.atomic import atomic_write_bytes, temp_files
from shared.lifecycle import Stage
from tests.support.tmpfs import fill_volume, mounted_tmpfs

VOLUME = 1 << 20
PAYLOAD = 256 << 10
FAST = {"poll_s": 0.02, "retry_every_s": 0.5, "retry_gain_bytes": 64 << 10}


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_write_on_a_full_volume_holds_its_stage_and_lands_whole_once_space_is_back(tmp_path, redis_conn):
    with mounted_tmpfs(tmp_path / "volume", VOLUME) as fs:
        filler = fs.path / "neighbour.bin"
        fill_volume(filler)
        target = fs.path / "runs" / "r" / "drafter" / "checkpoint.bin"
        payload = bytes(range(256)) * (PAYLOAD // 256)
        hold, done = StageHold(redis_conn, "r", Stage.TRAIN), threading.Event()

        def write() -> None:
            write_with_space(lambda: atomic_write_bytes(target, payload), "checkpoint step 50", fs.path, hold=hold,
                             **FAST)
            done.set()

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        wait_until(lambda: disk_status(redis_conn, "r")["held"])
        reason = disk_status(redis_conn, "r")["held"]["train"]
        assert "writing checkpoint step 50 found" in reason and str(fs.path) in reason
        time.sleep(0.3)
        assert not done.is_set() and not target.exists() and temp_files(fs.path) == []  # each try left nothing

        filler.unlink()  # the neighbour's file goes
        writer.join(10)
        assert done.is_set() and target.read_bytes() == payload
        assert disk_status(redis_conn, "r")["held"] == {} and temp_files(fs.path) == []


def test_a_write_retries_after_its_interval_even_when_space_comes_back_in_small_steps(tmp_path):
    with mounted_tmpfs(tmp_path / "volume", VOLUME) as fs:
        filler = fs.path / "neighbour.bin"
        fill_volume(filler)
        target, done = fs.path / "small.bin", threading.Event()
        writer = threading.Thread(target=lambda: (write_with_space(
            lambda: atomic_write_bytes(target, b"x" * 8192), "a small file", fs.path, **FAST), done.set()), daemon=True)
        writer.start()
        time.sleep(0.2)
        with open(filler, "r+b") as handle:  # 16 KiB back: under the gain, so only the interval's retry sees it
            handle.truncate(filler.stat().st_size - (16 << 10))
        writer.join(10)
        assert done.is_set() and target.read_bytes() == b"x" * 8192


def test_other_errors_are_raised_at_once(tmp_path):
    calls = []

    def refuse() -> None:
        calls.append(1)
        raise PermissionError(errno.EACCES, "denied")

    with pytest.raises(PermissionError):
        write_with_space(refuse, "a file", tmp_path, **FAST)
    assert calls == [1]
    assert no_space(OSError(errno.EDQUOT, "quota")) and not no_space(OSError(errno.EIO, "io"))


def test_a_line_cut_short_by_a_full_disk_is_taken_back_whole(tmp_path):
    with mounted_tmpfs(tmp_path / "volume", VOLUME) as fs:
        log_path = fs.path / "train_log.jsonl"
        append_line(log_path, '{"step": 1}')
        fill_volume(fs.path / "neighbour.bin", keep=4096)
        with pytest.raises(OSError) as raised:
            append_line(log_path, "x" * (64 << 10))  # more than the space left: written in part, then ENOSPC
        assert no_space(raised.value)
        assert log_path.read_text() == '{"step": 1}\n'
