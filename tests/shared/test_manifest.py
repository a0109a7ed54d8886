"""Shard manifests: concurrent appends from several processes, torn lines, checks against an entry."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from shared.errors import HiddenStateFileError
from shared.hidden_file import verify_hidden_file
from shared.manifest import ManifestEntry, append_entry, check_deep, check_quick, read_manifest
from tests.shared.test_hidden_file import write_sample
from tests.support.processes import REPO

WRITERS, PER_WRITER = 4, 150


def entry(sample_id: int, **overrides) -> ManifestEntry:
    fields = dict(sample_id=sample_id, sha256="ab" * 32, bytes=1000 + sample_id, num_tokens=7, dtype="BF16",
                  layer_ids=[1, 3, 4], at=1.0)
    return ManifestEntry(**{**fields, **overrides})


def test_appends_from_several_processes_lose_and_tear_no_line(tmp_path):
    path = tmp_path / "rows_000000-001999" / "manifest.jsonl"
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from shared.manifest import ManifestEntry, append_entry
        writer = int(sys.argv[1])
        for i in range({PER_WRITER}):
            sample_id = writer * 100000 + i
            # long layer lists make each line several KiB, so interleaved writes would show
            append_entry(Path({str(path)!r}), ManifestEntry(sample_id, "f" * 64, i, i, "BF16", list(range(600)), 1.0))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(w)], cwd=REPO) for w in range(WRITERS)]
    assert [p.wait(120) for p in procs] == [0] * WRITERS
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""  # every line complete
    records = [json.loads(line) for line in lines[:-1]]
    assert len(records) == WRITERS * PER_WRITER
    assert sorted(r["sample_id"] for r in records) == sorted(w * 100000 + i for w in range(WRITERS) for i in range(PER_WRITER))
    assert len(read_manifest(path)) == WRITERS * PER_WRITER


def test_the_last_entry_of_a_sample_wins(tmp_path):
    path = tmp_path / "manifest.jsonl"
    append_entry(path, entry(3, num_tokens=5))
    append_entry(path, entry(4))
    append_entry(path, entry(3, num_tokens=9))
    entries = read_manifest(path)
    assert set(entries) == {3, 4} and entries[3].num_tokens == 9


def test_a_torn_last_line_is_skipped_and_the_next_append_starts_a_fresh_line(tmp_path):
    path = tmp_path / "manifest.jsonl"
    append_entry(path, entry(1))
    with open(path, "ab") as handle:
        handle.write(entry(2).to_line()[:40])  # a writer died mid-line
    assert set(read_manifest(path)) == {1}
    append_entry(path, entry(3))
    assert set(read_manifest(path)) == {1, 3}
    assert path.read_bytes().count(b"\n") == 3


def test_a_missing_manifest_is_empty(tmp_path):
    assert read_manifest(tmp_path / "nope.jsonl") == {}


@pytest.fixture()
def sample(tmp_path):
    path = write_sample(tmp_path / "00000007.safetensors", tokens=6, hidden=4)
    return path, ManifestEntry.from_info(7, verify_hidden_file(path))


def test_an_intact_file_passes_both_checks(sample):
    path, recorded = sample
    check_quick(path, recorded)
    assert check_deep(path, recorded).sha256 == recorded.sha256


def test_quick_check_catches_a_truncated_file_and_a_bad_header(sample):
    path, recorded = sample
    raw = path.read_bytes()
    path.write_bytes(raw[:-10])
    with pytest.raises(HiddenStateFileError, match="bytes on disk"):
        check_quick(path, recorded)
    path.write_bytes(raw[:8] + b"#" + raw[9:])  # same size, header no longer JSON
    with pytest.raises(HiddenStateFileError, match="not valid JSON"):
        check_quick(path, recorded)


def test_quick_check_compares_the_header_with_the_entry(sample):
    path, recorded = sample
    with pytest.raises(HiddenStateFileError, match="num_tokens"):
        check_quick(path, entry(7, bytes=recorded.bytes, num_tokens=5))
    with pytest.raises(HiddenStateFileError, match="layer_ids"):
        check_quick(path, entry(7, bytes=recorded.bytes, num_tokens=6, layer_ids=[0, 1, 2]))


def test_only_the_deep_check_reads_the_data_and_catches_a_checksum_mismatch(sample):
    path, recorded = sample
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01  # lowest mantissa bit of the last bf16 value: still finite, same size and header
    path.write_bytes(bytes(raw))
    check_quick(path, recorded)
    with pytest.raises(HiddenStateFileError, match="checksum"):
        check_deep(path, recorded)


def test_entry_records_what_the_verified_file_is(sample):
    path, recorded = sample
    assert (recorded.sample_id, recorded.num_tokens, recorded.dtype, recorded.layer_ids) == (7, 6, "BF16", [1, 3, 4])
    assert recorded.bytes == path.stat().st_size and recorded.at > 0
