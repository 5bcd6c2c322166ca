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
        self._buffer = ""
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[SSERecord]:
        """Records completed by this chunk, in order."""
        self._buffer += self._text.decode(chunk)
        records: list[SSERecord] = []
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                break
            line, self._buffer = self._buffer[: cut[0]], self._buffer[cut[1]:]
            record = self._line(line)
            if record is not None:
                records.append(record)
        return records

    def _line(self, line: str) -> SSERecord | None:
        if not line:
            return self._dispatch() if self._data else self._reset()
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


def _line_end(buffer: str) -> tuple[int, int] | None:
    """(end of line, start of next) for the first complete line, or None."""
    match = _EOL.search(buffer)
    return (match.start(), match.end()) if match else None
