"""Running turns belong to the server: each runs in a task of its own, its events numbered and kept.

A route begins a turn (`Turns.begin`) and hands it to the hub, which runs the pipeline in its own
task, encodes each event once (`streaming.encode`, SSE id = its number in the turn, from 1) and
appends the frame to the turn's log. Any number of streams follow the log from any position: the
one that started the turn from the first event, a re-attached page from its `Last-Event-ID`. A
follower only reads the log at its own pace, so a slow or stalled one never holds the turn up.
The log is kept until the turn ends and KEEP_AFTER_END seconds more, so a reconnect racing the
end still gets the tail.

`stop` cancels the turn's task: the upstream socket is closed, the pipeline saves the partial
reply as interrupted (once), and the log ends with a `done` whose status is `interrupted`.

`TurnHub` is what routes see. `LocalTurnHub` keeps everything in this process's memory;
`redis_turn_hub.RedisTurnHub` adds a copy of each log in Redis and a stop by publish/subscribe,
for turns that run in another process. This module knows tasks and frames, not wire
formats, the store's layout, or HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

import anyio

from chatserver import metrics
from chatserver.api.sse import encode
from chatserver.store.files import NotFound, StoreUnavailable
from chatserver.store.person_events import PersonEvents, tell_turn
from chatserver.turns.checkpoints import keep_checkpoints
from chatserver.turns.compare import Comparison
from chatserver.turns.events import LaneEvent, TurnDone, TurnEvent
from chatserver.turns.pipeline import Turn, Turns
from chatserver.turns.reply import done_event

log = logging.getLogger("chat.turn_hub")

# How long a finished turn's events stay readable: a reconnect that races the end still gets them.
KEEP_AFTER_END = 30.0
# How long `stop` waits for the stopped turn to save and let the conversation go.
STOP_WAIT = 10.0


class TurnLog:
    """One turn's SSE frames in order (frame n has id n) and a way to wait for the next one."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.ended = False
        self._grew = asyncio.Event()

    def append(self, frame: bytes) -> None:
        self.frames.append(frame)
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    async def wait_past(self, count: int) -> None:
        """Return once the log holds more than `count` frames, or has ended."""
        while len(self.frames) <= count and not self.ended:
            await self._grew.wait()

    def _wake(self) -> None:
        # One event per step: every follower waiting now wakes, later waiters wait for the next step.
        self._grew.set()
        self._grew = asyncio.Event()

    async def follow(self, after: int) -> AsyncIterator[bytes]:
        """Every frame after id `after`, then the new ones as they come, until the turn ends.

        A follower that fell behind gets what it missed as one chunk: one send, not one per frame.
        """
        position = max(after, 0)
        while True:
            if position < len(self.frames):
                chunk = self.frames[position] if position + 1 == len(self.frames) \
                    else b"".join(self.frames[position:])
                position = len(self.frames)
                yield chunk
            elif self.ended:
                return
            else:
                await self._grew.wait()


class RunningTurn:
    """A turn in its own task, with the log of what it has said so far."""

    def __init__(self, turn: Turn | Comparison) -> None:
        self.turn = turn
        self.log = TurnLog()
        self.task: asyncio.Task | None = None
        self.finished = False  # its last event (`done` or `error`) is in the log
        self._scope = anyio.CancelScope()

    @property
    def conv_id(self) -> str:
        return self.turn.conv_id

    def info(self) -> dict:
        """`Conversation.turn`: the reply being written and how many events it has sent."""
        info = {"assistant_message_id": self.turn.assistant_id, "events": len(self.log.frames)}
        if isinstance(self.turn, Comparison):
            info["compare"] = self.turn.info()
        return info

    def follow(self, after: int) -> AsyncIterator[bytes]:
        return self.log.follow(after)

    async def stop_reply(self, assistant_id: str) -> None:
        """Stop one reply of a comparison (the others run on); a lone turn's own reply stops it whole."""
        if isinstance(self.turn, Comparison):
            await self.turn.stop_lane(assistant_id)
        elif assistant_id == self.turn.assistant_id:
            await self.stop()

    async def stop(self) -> None:
        """Cancel the turn and wait (bounded) until it has saved what arrived and let go."""
        if self.finished or self.task is None:
            return
        self._scope.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait([self.task], timeout=STOP_WAIT)

    async def drive(self, turns: Turns, checkpoint_seconds: float) -> None:
        turn = self.turn
        compared = isinstance(turn, Comparison)
        checkpoints = asyncio.create_task(keep_checkpoints(turn.lanes if compared else [turn], checkpoint_seconds)) \
            if checkpoint_seconds else None
        watch = TurnWatch(turn.first.model, {t.assistant_id: t.model for t in turn.lanes}) if compared \
            else TurnWatch(turn.model)
        try:
            with self._scope:
                async with contextlib.aclosing(turn.run(turns) if compared else turns.run(turn)) as events:
                    async for event in events:
                        watch.saw(event)
                        self._say(event)
            if not self.finished:
                # Stopped: the pipeline saved the partial reply on its way out; every follower learns how it ended.
                with anyio.CancelScope(shield=True):
                    for event in await turn.stopped_events() if compared else [await self._stopped_done()]:
                        self._say(watch.saw(event))
        finally:
            watch.ended()
            if checkpoints is not None:
                checkpoints.cancel()
            try:
                await (turn.release(turns) if compared else turns.release(turn))
            except StoreUnavailable:
                pass  # the pipeline already releases the lock once the store is back
            finally:
                self.log.end()  # whatever happened, every follower's stream ends

    def _say(self, event) -> None:
        if (frame := encode(event, len(self.log.frames) + 1)) is not None:
            self.log.append(frame)
        if event.type in ("done", "error"):
            self.finished = True

    async def _stopped_done(self) -> TurnDone:
        """The `done` of a stopped turn, with the usage the pipeline stored (None when nothing was)."""
        turn = self.turn
        stored = None
        with contextlib.suppress(NotFound):
            conv = await turn.store.get(turn.conv_id)
            stored = next((m for m in reversed(conv["messages"]) if m["id"] == turn.assistant_id), None)
        return done_event(turn.assistant_id, stored, "interrupted")


class TurnWatch:
    """What one turn tells /metrics: its first token, how it ended, what it used."""

    def __init__(self, model: str, lanes: dict[str, str] | None = None) -> None:
        self.model = model
        self.lanes = lanes or {}  # a comparison's replies: assistant message id -> its model
        self.began = time.monotonic()
        self.first = False
        self.outcome, self.kind = "interrupted", ""  # a turn cut off before its last event

    def saw(self, event: TurnEvent) -> TurnEvent:
        inner = event.event if isinstance(event, LaneEvent) else event
        if inner.type == "delta" and not self.first:
            self.first = True
            metrics.active.first_token.observe(time.monotonic() - self.began)
        elif isinstance(inner, TurnDone):
            model = self.lanes.get(event.assistant_message_id, self.model) if isinstance(event, LaneEvent) \
                else self.model
            metrics.active.usage(model, inner.usage)
        if event.type == "done":  # the turn's own end (a comparison's comes after its replies')
            self.outcome = "complete" if event.status == "complete" else "interrupted"
        elif event.type == "error":
            self.outcome, self.kind = "failed", event.kind
        return event

    def ended(self) -> None:
        metrics.active.turn_ended(self.outcome, self.kind, time.monotonic() - self.began)


class Started(Protocol):
    """A turn just handed to a hub, as the route that began it sees it."""

    def follow(self, after: int) -> AsyncIterator[bytes]:
        """Its frames after id `after`, then the live ones, to its last."""

    async def stop(self) -> None:
        """Stop it (if it still runs) and wait until it has saved."""


class TurnHub(Protocol):
    """The running turns, as the routes see them (owner checks are the routes' business).

    Reads are async so that a hub whose log and stop signal live in Redis fits the same shape.
    """

    def start(self, turn: Turn | Comparison) -> Started:
        """Run a begun turn (or comparison) to its end in a task of the server's own."""

    async def info(self, conv_id: str) -> dict | None:
        """The running turn of a conversation (`Conversation.turn`), or None."""

    async def follow(self, conv_id: str, after: int) -> AsyncIterator[bytes] | None:
        """The turn's frames after id `after`, then live ones; None when there is nothing to follow."""

    async def stop(self, conv_id: str) -> None:
        """Stop the conversation's running turn, if any, and wait until it has saved."""

    async def stop_reply(self, conv_id: str, assistant_id: str) -> None:
        """Stop one reply of the conversation's running comparison (or its turn writing that reply)."""

    async def close(self) -> None:
        """Stop every running turn (at shutdown)."""


class LocalTurnHub:
    """Turns of this process, their logs in its memory."""

    def __init__(self, turns: Turns, events: PersonEvents | None = None) -> None:
        self.turns = turns
        self.events = events if events is not None else PersonEvents()
        self._latest: dict[str, RunningTurn] = {}  # per conversation: its running turn, or the last one kept
        self._running: set[RunningTurn] = set()

    def start(self, turn: Turn | Comparison) -> RunningTurn:
        running = RunningTurn(turn)
        self._latest[turn.conv_id] = running
        self._running.add(running)
        running.task = asyncio.create_task(running.drive(self.turns, self.turns.settings.checkpoint_seconds),
                                           name=f"turn {turn.conv_id}")
        running.task.add_done_callback(lambda _: self._ended(running))
        tell_turn(self.events, turn.store.owner, turn.conv_id, started=True)
        return running

    def _ended(self, running: RunningTurn) -> None:
        self._running.discard(running)
        tell_turn(self.events, running.turn.store.owner, running.conv_id, started=False)  # released by now
        if not running.task.cancelled() and (exc := running.task.exception()) is not None:
            log.error("the turn on %s broke: %r", running.conv_id, exc)
        asyncio.get_running_loop().call_later(KEEP_AFTER_END, self._forget, running)

    def _forget(self, running: RunningTurn) -> None:
        if self._latest.get(running.conv_id) is running:
            del self._latest[running.conv_id]

    def running(self, conv_id: str) -> RunningTurn | None:
        """The conversation's turn until its last event is out (its reply is saved by then)."""
        running = self._latest.get(conv_id)
        return running if running is not None and not (running.finished or running.log.ended) else None

    async def info(self, conv_id: str) -> dict | None:
        running = self.running(conv_id)
        return running.info() if running is not None else None

    async def follow(self, conv_id: str, after: int) -> AsyncIterator[bytes] | None:
        kept = self._latest.get(conv_id)
        if kept is None or (kept.log.ended and after >= len(kept.log.frames)):
            return None
        return kept.log.follow(after)

    async def stop(self, conv_id: str) -> None:
        if (running := self.running(conv_id)) is not None:
            await running.stop()

    async def stop_reply(self, conv_id: str, assistant_id: str) -> None:
        if (running := self.running(conv_id)) is not None:
            await running.stop_reply(assistant_id)

    async def close(self) -> None:
        await asyncio.gather(*(running.stop() for running in list(self._running)))
