"""Size-limited tmpfs mounts for disk-full tests: a real small file system that really fills up.

Mounting needs root (or CAP_SYS_ADMIN), which CI and the test machines have; elsewhere the test skips
and says why. Every mount is unmounted when its context ends, also when the test fails.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


class Tmpfs:
    def __init__(self, path: Path, size: int, *, read_only: bool = False) -> None:
        self.path = Path(path)
        self.size = size
        self.read_only = read_only

    def mount(self) -> Tmpfs:
        self.path.mkdir(parents=True, exist_ok=True)
        options = f"size={self.size},mode=0755" + (",ro" if self.read_only else "")
        _run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(self.path)])
        return self

    def resize(self, size: int) -> None:
        """Grow (or shrink) the mounted file system in place, as an operator enlarging a volume would."""
        _run(["mount", "-o", f"remount,size={size}", str(self.path)])
        self.size = size

    def unmount(self) -> None:
        if not os.path.ismount(self.path):
            return
        if subprocess.run(["umount", str(self.path)], check=False, capture_output=True).returncode != 0:
            _run(["umount", "-l", str(self.path)])  # a process still holds a file: detach now, free later

    def free(self) -> int:
        stat = os.statvfs(self.path)
        return stat.f_bavail * stat.f_frsize

    def fill(self, leave: int, name: str = "filler") -> Path:
        """Write a file that leaves about ``leave`` bytes free (tmpfs counts whole pages)."""
        path = self.path / name
        with open(path, "wb") as handle:
            handle.write(b"\0" * max(self.free() - leave, 0))
        return path


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise MountRefused(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")


class MountRefused(RuntimeError):
    """The system does not let this process mount or remount a file system."""


@contextmanager
def mounted_tmpfs(path: Path, size: int, *, read_only: bool = False) -> Iterator[Tmpfs]:
    """A tmpfs of ``size`` bytes at ``path`` for the body of the ``with``; skips the test if mounting is refused."""
    fs = Tmpfs(path, size, read_only=read_only)
    try:
        fs.mount()
    except (MountRefused, FileNotFoundError) as exc:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root or CAP_SYS_ADMIN): {exc}")
    try:
        yield fs
    finally:
        fs.unmount()


def fill_volume(path: Path, keep: int = 0) -> Path:
    """Another process's file at ``path`` that takes the volume's free space but ``keep`` bytes (about: tmpfs
    counts whole pages); delete it to give the space back."""
    path = Path(path)
    with open(path, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    if keep:
        with open(path, "r+b") as handle:
            handle.truncate(max(path.stat().st_size - keep, 0))
    return path
