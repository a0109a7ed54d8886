"""Read a dataset that is one JSON array of rows (ShareGPT's ``ShareGPT_V3_unfiltered_cleaned_split.json``)
record by record, in memory bounded by the largest record, never the file.

Each element of the array comes out as its parsed value or as a ``Bad`` naming why it cannot be read and
where (its byte offset in the file): a malformed element, an element larger than the limit (skipped
without being held whole), or the element the file ends inside. A file cut off mid-record (the packaged
ShareGPT file is, after 17,671 conversations) thus yields every complete record and one named bad row
for the torn tail, never an error for the whole file and never a silent drop.

Parsing is ``json.JSONDecoder.raw_decode`` over a sliding buffer, at C speed. Only when an element does
not parse does a small scanner (strings, escapes and bracket depth) find where it ends, to tell a
record that is still arriving from one that is malformed, and to skip past it.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from shared.errors import DatasetError

CHUNK_CHARS = 1 << 20
WHITESPACE = " \t\r\n"
_SPECIAL = re.compile(r'[\[\]{}",\\]')  # what the scanner must look at; everything else it jumps over
_IN_STRING = re.compile(r'["\\]')  # inside a string only its end and escapes matter


@dataclass(frozen=True)
class Bad:
    """An element that cannot be a row: ``kind`` is "json", "too_large" or "utf8"."""

    kind: str
    message: str


class NotAnArray(DatasetError):
    """A ``.json`` dataset that is not one JSON array (JSON lines belong in ``.jsonl``)."""


class _Scan:
    """Where one JSON element ends, fed piece by piece: the index just past it, once it has ended."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False

    def feed(self, text: str, start: int) -> int | None:
        """The end of the element in ``text[start:]`` (continuing the state of earlier pieces), or None."""
        i = start
        while i < len(text):
            if self.in_string:
                if self.escape:
                    self.escape, i = False, i + 1
                    continue
                match = _IN_STRING.search(text, i)
                if match is None:
                    return None
                i = match.start()
                if text[i] == "\\":
                    self.escape = True
                else:
                    self.in_string = False
                i += 1
                continue
            match = _SPECIAL.search(text, i)
            if match is None:
                return None
            i, char = match.start(), match.group()
            if char == '"':
                self.in_string = True
            elif char in "[{":
                self.depth += 1
            elif char in "]}":
                if self.depth == 0:
                    return i  # the array's own "]" ends a scalar element
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif char == "," and self.depth == 0:
                return i
            i += 1
        return None


class ArrayReader:
    """The elements of the JSON array that ``handle`` holds, each a value or a ``Bad``."""

    def __init__(self, handle: BinaryIO, *, max_record_bytes: int, name: str) -> None:
        self.handle = handle
        self.max_record_bytes = max_record_bytes
        self.name = name
        # Invalid UTF-8 becomes lone surrogates, so only the record holding it fails (as "utf8").
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self.buf = ""
        self.pos = 0
        self.base = 0  # byte offset in the file of buf[0]
        self.eof = False
        self.decode = json.JSONDecoder().raw_decode

    # ---- the buffer ----------------------------------------------------------------------------------
    def _more(self) -> bool:
        """Append the next piece of the file; False at its end."""
        if self.eof:
            return False
        raw = self.handle.read(CHUNK_CHARS)
        if not raw:
            self.eof = True
            self.buf += self.decoder.decode(b"", final=True)
            return False
        if self.base == 0 and not self.buf and raw.startswith(codecs.BOM_UTF8):
            raw, self.base = raw[len(codecs.BOM_UTF8):], len(codecs.BOM_UTF8)
        self.buf += self.decoder.decode(raw)
        return True

    def _compact(self) -> None:
        if self.pos > CHUNK_CHARS:
            self.base += len(self.buf[: self.pos].encode("utf-8", "surrogateescape"))
            self.buf, self.pos = self.buf[self.pos:], 0

    def offset(self, at: int) -> int:
        """The byte offset in the file of ``buf[at]``."""
        return self.base + len(self.buf[:at].encode("utf-8", "surrogateescape"))

    def _peek(self) -> str | None:
        """The next character that is not whitespace (pos moved onto it), or None at the end of the file."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in WHITESPACE:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            self._compact()
            if not self._more() and self.pos >= len(self.buf):
                return None

    # ---- the array -----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[object | Bad]:
        if self._peek() != "[":
            raise NotAnArray(f"{self.name}: a .json dataset must be one JSON array of rows "
                             "(one JSON object per line belongs in a .jsonl file)")
        self.pos += 1
        first = True
        while True:
            char = self._peek()
            if char is None:
                return  # cut off between records: every record so far is complete, none is lost
            if char == "]":
                self.pos += 1
                return
            if not first:
                if char != ",":
                    yield self._bad_element("json", "expected ',' between the array's rows")
                    continue
                self.pos += 1
                char = self._peek()
                if char is None or char == "]":
                    continue
            first = False
            yield self._element()
            self._compact()

    def _element(self) -> object | Bad:
        start = self.pos
        while True:
            try:
                value, end = self.decode(self.buf, start)
            except json.JSONDecodeError:
                pass
            except (ValueError, RecursionError) as exc:  # a 5,000-digit number, nesting thousands deep
                return self._bad_element("json", f"JSON this reader refuses ({type(exc).__name__})")
            else:
                if end < len(self.buf) or self.eof:
                    self.pos = end
                    if self._size(start, end) > self.max_record_bytes:  # it arrived in one piece
                        return Bad("too_large", f"the row at byte {self.offset(start)}: more than the "
                                                f"{self.max_record_bytes} byte limit")
                    return value if not _has_surrogates(value) else Bad(
                        "utf8", f"the row at byte {self.offset(start)} holds invalid UTF-8")
                self._more()  # a number at the buffer's end may go on in the next piece
                continue
            # Not parsed: malformed if it has ended, else still arriving (or too large, or cut off).
            ended = _Scan().feed(self.buf, start)
            if ended is not None:
                return self._bad_element("json", "invalid JSON")
            if len(self.buf) - start > self.max_record_bytes:
                return self._bad_element("too_large", f"more than the {self.max_record_bytes} byte limit")
            if not self._more():
                offset, size = self.offset(start), len(self.buf[start:].encode("utf-8", "surrogateescape"))
                self.pos = len(self.buf)
                return Bad("json", f"the row at byte {offset} is cut off: the file ends inside it, {size} bytes "
                                   "after its start")

    def _size(self, start: int, end: int) -> int:
        """Bytes of buf[start:end] (encoded only when its characters could exceed the limit)."""
        if (end - start) * 4 <= self.max_record_bytes:
            return end - start
        return len(self.buf[start:end].encode("utf-8", "surrogateescape"))

    def _bad_element(self, kind: str, why: str) -> Bad:
        """Skip the element at pos (bounded: nothing past the buffer is kept) and name it."""
        start_offset = self.offset(self.pos)
        scan = _Scan()
        while True:
            end = scan.feed(self.buf, self.pos)
            if end is not None:
                # An empty element ("[1,,2]") ends where it starts, on the next separator, which stays for
                # the array; anything else (a stray "}") is consumed, so the read always moves on.
                self.pos = end if end > self.pos or self.buf[end] == "," else end + 1
                return Bad(kind, f"the row at byte {start_offset}: {why}")
            self.base += len(self.buf.encode("utf-8", "surrogateescape"))
            self.buf, self.pos = "", 0
            if not self._more():
                return Bad(kind, f"the row at byte {start_offset}: {why}; the file ends inside it")


def _has_surrogates(value: object) -> bool:
    if isinstance(value, str):
        return any("\udc80" <= ch <= "\udcff" for ch in value)
    if isinstance(value, dict):
        return any(_has_surrogates(k) or _has_surrogates(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogates(v) for v in value)
    return False
