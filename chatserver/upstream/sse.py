"""A buffered Server-Sent Events decoder, as the WHATWG spec describes it.

Network reads split lines and multi-byte characters anywhere; the decoder keeps the partial
line and the partial character until the rest arrives. It yields whole records and knows
nothing of what their `data` means. A record is dispatched only by its blank line: whatever is
pending when the body ends is discarded, as the specification says (a stream cut mid-record
must not pass for a whole one).
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SSERecord:
    event: str
    data: str


class SSEDecoder:
    def __init__(self) -> None:
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # The start of a line whose end has not arrived, in pieces: a long line is joined once, and
        # searched once, rather than copied and searched again with every read.
        self._pending: list[str] = []
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[SSERecord]:
        """Records completed by this chunk, in order."""
        text = self._text.decode(chunk)
        if self._pending and self._pending[-1].endswith("\r"):
            # A CR that ended the last read: a line end, unless this read begins with its LF.
            self._pending[-1] = self._pending[-1][:-1]
            text = "\r" + text
        records: list[SSERecord] = []
        start = 0
        while (match := _EOL.search(text, start)) is not None:
            record = self._line("".join([*self._pending, text[start:match.start()]]))
            self._pending.clear()
            if record is not None:
                records.append(record)
            start = match.end()
        if start < len(text):
            self._pending.append(text[start:])
        return records

    def _line(self, line: str) -> SSERecord | None:
        if not line:
            if self._data:
                return self._dispatch()
            self._reset()
            return None
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None

    def _dispatch(self) -> SSERecord:
        record = SSERecord(self._event or "message", "\n".join(self._data))
        self._reset()
        return record

    def _reset(self) -> None:
        self._event = ""
        self._data = []


# A lone CR at the very end is not yet a line end: its LF may come in the next read.
_EOL = re.compile(r"\r\n|\n|\r(?=.)", re.S)

