"""Checkpoints: a streaming reply's partial text, activity and usage, written to the store as it grows.

While a turn streams, `keep_checkpoints` stores the reply so far as an assistant message with
`status: "streaming"` (a comparison's replies all together, the others off the path as the
first's siblings), at most once every CHECKPOINT_SECONDS, from a task of its own so that no
event ever waits for a write. Each checkpoint replaces the previous one in place (same message
id; `storage.place_checkpoint`); the pipeline's final save replaces the last one, so the reply is
still stored once, and a settled reply is never overwritten by a late checkpoint. Writes carry
the turn's lock: once the turn has let the conversation go, a checkpoint is refused.

After a crash the last checkpoint is what is left; the store turns it into an `interrupted`
reply (`storage.recover_interrupted`). This module knows the reply's shape, not the store's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from chatserver.store.files import LockLost, NotFound
from chatserver.turns import context
from chatserver.turns.pipeline import Turn
from chatserver.turns.reply import reply_message, reply_usage

log = logging.getLogger("chat.checkpoints")


class OutputCount:
    """A growing reply's output tokens, counted as it grows.

    Each checkpoint tokenizes only the words added since the one before, not the whole reply
    again: on a 4,000-token reply a whole count costs the event loop about a millisecond, every
    second, for every reply streaming. Counts stop at a space, which cl100k tokens begin with, so
    the pieces add up to the whole reply's count; text without spaces (Chinese, Japanese) is cut
    every few hundred characters instead, at a token or so each time. Nothing goes into the
    shared token cache, which keeps the counts of the messages that are counted again.
    """

    PIECE_WITHOUT_SPACE = 512

    def __init__(self) -> None:
        self.counted = ""  # the text counted so far
        self.tokens = 0

    def of(self, text: str) -> int:
        if not text.startswith(self.counted):  # the reply started over (a resend)
            self.counted, self.tokens = "", 0
        start = len(self.counted)
        cut = text.rfind(" ", start)
        if cut <= start and len(text) - start > self.PIECE_WITHOUT_SPACE:
            cut = len(text)
        if cut > start:
            self.tokens += context.count_tokens_uncached(text[start:cut])
            self.counted = text[:cut]
        return self.tokens + context.count_tokens_uncached(text[len(self.counted):])


def checkpoint_message(turn: Turn, output: OutputCount) -> dict:
    """The reply so far, as the assistant message a crash would leave behind; its usage is always
    flagged as an estimate."""
    counting = turn.counting
    sent_floor = counting.result() if counting is not None and counting.done() and not counting.cancelled() \
        and counting.exception() is None else 0
    usage, _ = reply_usage(turn, sent_floor, output_tokens=output.of(turn.reply.text))
    usage["estimated"] = True
    return reply_message(turn, "streaming", usage, snapshot=True)


async def keep_checkpoints(lanes: Sequence[Turn], every: float) -> None:
    """Write the growing replies every `every` seconds until each has settled (run it as its own task).

    A lone turn is one lane. A comparison's lanes are written together, the first model's reply on
    the path and the others off it as its siblings: each checkpoint holds the newest state of every
    reply still streaming, so a crash leaves each of them as far as it had come.
    """
    # A reply being continued is stored settled, and a checkpoint never touches a settled reply.
    lanes = [lane for lane in lanes if lane.continues is None]
    if not lanes:
        return
    first = lanes[0]
    written: dict[str, tuple] = {}
    outputs = {lane.assistant_id: OutputCount() for lane in lanes}
    while not all(lane.settled for lane in lanes):
        await asyncio.sleep(every)  # the cadence itself, not a wait for something to happen
        live = [lane for lane in lanes if not lane.settled and lane.reply.has_output]
        marks = {lane.assistant_id: _mark(lane) for lane in live}
        if all(written.get(aid) == mark for aid, mark in marks.items()):
            continue
        on_path, off_path = None, []
        for lane in live:
            message = checkpoint_message(lane, outputs[lane.assistant_id])
            if lane.lane is None or lane.lane.primary:
                on_path = message
            else:
                off_path.append(message)
        try:
            await first.store.checkpoint(first.conv_id, on_path, off_path=off_path, lock=first.lock)
        except (LockLost, NotFound):
            return  # the turn is over or the conversation is gone: nothing left to keep
        except Exception:
            # A failed checkpoint costs only what a crash would lose; the turn itself goes on.
            log.exception("checkpoint of the reply on %s failed", first.conv_id)
        written.update(marks)


def _mark(lane: Turn) -> tuple[int, int, int, int]:
    """How far a reply has come: a checkpoint is written only when one of them moved."""
    reply = lane.reply
    return len(reply.text), len(reply.reasoning), len(reply.activity), len(reply.usages)
