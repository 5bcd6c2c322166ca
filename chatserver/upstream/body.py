"""A request body as the pieces it is sent in: runs of history encoded once, never copied again.

A conversation's walked history (turns/context.py) keeps its messages encoded as a few runs of
JSON array elements. Encoding a body with them inside would copy megabytes into a fresh buffer
every turn, and in a running server the copy's page faults cost more than the encoding (about
5 ms for a 10,000-message history). Instead the body around the runs is encoded, a hole left
where each run goes, and the runs are sent from where they already are.
"""

from __future__ import annotations

import orjson

# What the encoder writes where a run goes. orjson escapes every control character in a string,
# so a raw NUL byte appears in its output only where this hole was put.
_HOLE = orjson.Fragment(b"\x00")


class Encoded:
    """Array elements already encoded as JSON (`{..},{..}`, never empty), in a list to be sent."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def body_pieces(body: dict) -> list[bytes]:
    """`body` as JSON, in pieces whose concatenation is the whole; its `Encoded` runs are pieces of their own."""
    runs: list[bytes] = []

    def hole(obj: object) -> orjson.Fragment:
        if isinstance(obj, Encoded):
            runs.append(obj.data)
            return _HOLE
        raise TypeError(f"{type(obj).__name__} is not JSON")

    around = orjson.dumps(body, default=hole).split(b"\x00")
    pieces = [around[0]]
    for run, after in zip(runs, around[1:], strict=True):
        pieces += (run, after)
    return pieces
