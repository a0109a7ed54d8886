"""Reading datasets: every row format, every kind of bad row named, Parquet batches, the Hub cache offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.controller.runs import datasets
from services.controller.runs.datasets import iter_rows
from shared.errors import DatasetError, PromptTooLong, RowError
from tests.support.processes import REPO

GOOD = {"prompt": "What is two plus two?"}


def write_jsonl(path: Path, lines: list[bytes | str | dict]) -> Path:
    raw = [line if isinstance(line, bytes) else (line if isinstance(line, str) else json.dumps(line)).encode() for line in lines]
    path.write_bytes(b"\n".join(raw) + b"\n")
    return path


def test_three_row_formats_normalize_to_chat_messages(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Count to 3"},
                      {"role": "assistant", "content": "1 2 3"}]},
        {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q1"},
                           {"from": "gpt", "value": "A1"}, {"from": "human", "value": "Q2"}]},
        {"prompt": "Plain question", "system": "Plain system"},
        {"prompt": "No system"},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]}]},
    ])
    rows = list(iter_rows(path))
    assert [i for i, _ in rows] == [0, 1, 2, 3, 4]
    assert rows[0][1] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Count to 3"}]
    assert rows[1][1] == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                          {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}]
    assert rows[2][1] == [{"role": "system", "content": "Plain system"}, {"role": "user", "content": "Plain question"}]
    assert rows[3][1] == [{"role": "user", "content": "No system"}]
    assert rows[4][1] == [{"role": "user", "content": "part one, part two"}]

def test_with_replies_keeps_a_valid_rows_last_replies_and_changes_no_rows_validity(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [
        {"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"},
                           {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]},
        {"conversations": [{"from": "gpt", "value": "only a reply"}]},  # nothing to answer: fails either way
        {"prompt": "P"},
    ])
    plain, written = list(iter_rows(path)), list(iter_rows(path, with_replies=True))
    assert plain[0][1][-1] == {"role": "user", "content": "Q2"}  # the target writes the last reply
    assert written[0][1] == [*plain[0][1], {"role": "assistant", "content": "A2"}]
    assert type(plain[1][1]) is type(written[1][1]) and isinstance(written[1][1], RowError)
    assert written[2] == plain[2] == (2, [{"role": "user", "content": "P"}])



BAD_LINES = [
    (b"{this is not json", "InvalidJson", "invalid JSON"),
    (b'{"prompt": "caf\xe9"}', "InvalidUtf8", "UTF-8"),
    (b"   ", "EmptyRow", "blank"),
    (b"{}", "EmptyRow", "no fields"),
    (b'{"text": "hello"}', "MissingField", "'messages', 'conversations', 'prompt'"),
    (b"[1, 2]", "WrongType", "list"),
    (b'{"prompt": 42}', "WrongType", "prompt is an int, expected a string"),
    (b'{"messages": "hi"}', "WrongType", "messages is a str"),
    (b'{"messages": []}', "EmptyRow", "messages is an empty list"),
    (b'{"messages": [{"content": "x"}]}', "MissingField", "no 'role'"),
    (b'{"messages": [{"role": "tool", "content": "x"}]}', "UnknownRole", "'tool'"),
    (b'{"messages": [{"role": "user", "content": "  "}]}', "EmptyContent", "empty content"),
    (b'{"messages": [{"role": "system", "content": "x"}]}', "NoUserTurn", "no user turn"),
    (b'{"messages": [{"role": "assistant", "content": "x"}]}', "NoUserTurn", "no user turn"),
    (b'{"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "x"}]}', "NoUserTurn", "ends with a system turn"),
    (b'{"conversations": [{"from": "bot", "value": "x"}]}', "UnknownRole", "'bot'"),
    (b'{"conversations": [{"from": "human"}]}', "MissingField", "no 'value'"),
    (b'{"prompt": "ok", "system": ["x"]}', "WrongType", "system is a list"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}', "WrongType", "non-text part"),
]


@pytest.mark.parametrize(("line", "name", "words"), BAD_LINES, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD_LINES)])
def test_each_bad_row_is_named_and_fails_only_itself(tmp_path, line, name, words):
    path = write_jsonl(tmp_path / "rows.jsonl", [GOOD, line, GOOD])
    rows = list(iter_rows(path))
    assert [i for i, _ in rows] == [0, 1, 2]
    assert rows[0][1] == rows[2][1] == [{"role": "user", "content": GOOD["prompt"]}]
    error = rows[1][1]
    assert isinstance(error, RowError)
    assert type(error).__name__ == name
    assert words in str(error)


def test_prompt_over_256_kib_is_prompt_too_long(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "x" * (datasets.MAX_PROMPT_BYTES + 1)},
                                                 {"prompt": "x" * datasets.MAX_PROMPT_BYTES}])
    (_, first), (_, second) = iter_rows(path)
    assert isinstance(first, PromptTooLong) and "byte limit" in str(first)
    assert isinstance(second, list)


def test_limit_counts_rows_read_including_bad_ones(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [GOOD, b"{bad", GOOD, GOOD, GOOD])
    assert [i for i, _ in iter_rows(path, limit=3)] == [0, 1, 2]
    with pytest.raises(DatasetError, match="limit"):
        list(iter_rows(path, limit=0))


def test_parquet_is_read_in_batches_with_continuous_row_indices(tmp_path):
    n = datasets.PARQUET_BATCH_ROWS * 2 + 7
    messages = [[{"role": "user", "content": f"question {i}"}] for i in range(n)]
    messages[5] = None  # a null cell is a named bad row, not a crash
    table = pa.table({"messages": messages, "other": list(range(n))})
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path, row_group_size=500)
    rows = list(iter_rows(path))
    assert [i for i, _ in rows] == list(range(n))
    assert rows[n - 1][1] == [{"role": "user", "content": f"question {n - 1}"}]
    assert (type(rows[5][1]).__name__, str(rows[5][1])) == ("MissingField", "messages is null, expected a list of turns")


def test_parquet_sharegpt_and_prompt_columns(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"conversations": [[{"from": "human", "value": "hey"}], None],
                             "prompt": [None, "plain"], "system": [None, "sys"]}), path)
    assert [m for _, m in iter_rows(path)] == [
        [{"role": "user", "content": "hey"}],
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "plain"}],
    ]


def test_parquet_without_a_known_column_is_a_dataset_error(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": ["a"]}), path)
    with pytest.raises(DatasetError, match="no column named messages"):
        list(iter_rows(path))


def test_missing_path_is_a_clear_dataset_error(tmp_path):
    missing = tmp_path / "nope" / "rows.jsonl"
    with pytest.raises(DatasetError, match="no such file or directory") as info:
        list(iter_rows(missing))
    assert str(missing) in str(info.value)


def test_unknown_suffix_is_a_dataset_error(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("a,b\n")
    with pytest.raises(DatasetError, match="unknown dataset format"):
        list(iter_rows(path))


def test_directory_reads_only_the_split_in_name_order(tmp_path):
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "train-00001-of-00002.jsonl", [{"prompt": "second file"}])
    write_jsonl(tmp_path / "data" / "train-00000-of-00002.jsonl", [{"prompt": "first file"}, {"prompt": "first file b"}])
    write_jsonl(tmp_path / "data" / "test-00000-of-00001.jsonl", [{"prompt": "test split"}])
    write_jsonl(tmp_path / "pretrain.jsonl", [{"prompt": "not the train split"}])
    contents = [m[0]["content"] for _, m in iter_rows(tmp_path)]
    assert contents == ["first file", "first file b", "second file"]
    assert [m[0]["content"] for _, m in iter_rows(tmp_path, split="test")] == ["test split"]
    with pytest.raises(DatasetError, match="no .jsonl, .json or .parquet files for split 'validation'"):
        list(iter_rows(tmp_path, split="validation"))


def make_hub_cache(cache: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """The layout huggingface_hub itself writes: blobs, refs/main, snapshots/<sha>/ with links into blobs."""
    import hashlib

    owner, name = repo_id.split("/")
    repo = cache / f"datasets--{owner}--{name}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    for rel, content in files.items():
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        link = repo / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return repo


def parquet_bytes(tmp_path: Path, prompts: list[str]) -> bytes:
    path = tmp_path / "tmp.parquet"
    pq.write_table(pa.table({"prompt": prompts}), path)
    return path.read_bytes()


READ_SCRIPT = """
import json, sys
from services.controller.runs.datasets import iter_rows
from shared.errors import DatasetError
out = {}
for repo, split in [("owner/prompts", "train"), ("owner/prompts", "test"), ("owner/missing", "train")]:
    try:
        out[f"{repo}:{split}"] = [m if isinstance(m, list) else type(m).__name__ for _, m in iter_rows(repo, split=split)]
    except DatasetError as exc:
        out[f"{repo}:{split}"] = "DatasetError: " + str(exc)
print(json.dumps(out))
"""


def test_hub_repo_id_resolves_from_the_real_hub_cache_offline(tmp_path):
    cache = tmp_path / "hub"
    make_hub_cache(cache, "owner/prompts", {
        "data/train-00000-of-00002.parquet": parquet_bytes(tmp_path, ["hub one", "hub two"]),
        "data/train-00001-of-00002.parquet": parquet_bytes(tmp_path, ["hub three"]),
        "data/test-00000-of-00001.jsonl": b'{"prompt": "hub test"}\n{bad\n',
        "README.md": b"# a dataset card\n",
    })
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-c", READ_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["owner/prompts:train"] == [[{"role": "user", "content": c}] for c in ("hub one", "hub two", "hub three")]
    assert out["owner/prompts:test"] == [[{"role": "user", "content": "hub test"}], "InvalidJson"]
    assert out["owner/missing:train"].startswith("DatasetError: dataset 'owner/missing' is not a local path")
