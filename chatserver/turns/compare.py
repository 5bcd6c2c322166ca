"""Compare: one message answered by two or three models at once, each reply a turn of its own.

A comparison is one turn as the hub and the conversation's lock see it (one claim, one numbered
event log, one Stop, re-attach and Redis mirroring unchanged), made of lanes: a `pipeline.Turn` per
model, all answering the person's message, run side by side by `Turns.run`. Each lane's events
reach the page as `LaneEvent`s (the event's own name, the reply's id in its data), each lane ends
with its own `done` or `error`, and the comparison's `done` follows the last.

Promises:
- The replies are siblings: the first model's goes on the current path, the others off it, so
  choosing one later is a plain branch switch. A lane that fails before any output stores
  nothing and takes nothing back; when the first stored nothing, the first reply that was stored
  is made current; when none was, the person's message goes back to them.
- The lanes share the claim; only the comparison lets it go, once every lane has saved.
- `stop_lane` stops one reply (saved `interrupted`), the others run on; Stop stops them all.
- Compression, when the conversation is over its budget, runs once before the lanes start.

Checkpoints keep every lane (`keep_checkpoints`): the first model's reply on the path, the others
off it, as they will be saved. After a crash each reply is left `interrupted` as far as it had come.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio

from chatserver.conversations import branches
from chatserver.store.files import NotFound
from chatserver.turns import context
from chatserver.turns.claim import Claim
from chatserver.turns.events import CompareDone, CompareStarted, Compressed, LaneEvent, TurnEvent
from chatserver.turns.pipeline import Outcome, Turn, Turns
from chatserver.turns.reply import done_event


@dataclass(frozen=True, slots=True)
class Lane:
    """One reply's place in a comparison: the first model's reply goes on the current path, the
    others off it, as its siblings."""

    primary: bool

    def on_path(self, conv: dict) -> bool:
        return self.primary


class _Shared(Claim):
    """A lane's view of the comparison's claim: its release is the comparison's, after the last lane."""

    def __init__(self, claim: Claim) -> None:
        super().__init__(claim.store, claim.lock)

    async def release(self) -> None:
        return


class Comparison:
    def __init__(self, lanes: list[Turn], claim: Claim) -> None:
        self.lanes = lanes
        self.claim = claim
        self._scopes = {lane.assistant_id: anyio.CancelScope() for lane in lanes}
        self._tasks: dict[str, asyncio.Task] = {}
        self._announced: set[str] = set()  # replies whose `done` or `error` went out

    @classmethod
    def of(cls, turn: Turn, models: list[str]) -> Comparison:
        """A begun turn (the person's message added, answered by `models[0]`) and one more lane per other model."""
        assert turn.user_message is not None
        claim, shared = turn.claim, _Shared(turn.claim)
        turn.claim, turn.lane = shared, Lane(primary=True)
        others = [Turn(turn.store, shared, model, None, parent_id=turn.parent_id, previous_leaf=turn.previous_leaf,
                       opening=turn.opening, lane=Lane(primary=False)) for model in models[1:]]
        return cls([turn, *others], claim)

    # What the hub reads of a turn.

    @property
    def first(self) -> Turn:
        return self.lanes[0]

    @property
    def store(self):
        return self.first.store

    @property
    def conv_id(self) -> str:
        return self.first.conv_id

    @property
    def assistant_id(self) -> str:
        return self.first.assistant_id

    @property
    def outcome(self) -> Outcome:
        """SAVED when any reply was stored (the conversation then gets its title)."""
        return Outcome.SAVED if any(t.outcome is Outcome.SAVED for t in self.lanes) else self.first.outcome

    async def run(self, turns: Turns) -> AsyncIterator[TurnEvent]:
        first = self.first
        assert first.user_message is not None
        yield CompareStarted(first.user_message["id"],
                             tuple({"assistant_message_id": t.assistant_id, "model": t.model} for t in self.lanes),
                             first.masked)
        if (compressed := await self._make_room(turns)) is not None:
            yield compressed
        queue: asyncio.Queue[LaneEvent | Turn] = asyncio.Queue()
        for lane in self.lanes:
            self._tasks[lane.assistant_id] = asyncio.create_task(self._drive(turns, lane, queue),
                                                                 name=f"compared reply {lane.assistant_id}")
        try:
            running = len(self.lanes)
            while running:
                item = await queue.get()
                if isinstance(item, Turn):
                    running -= 1
                else:
                    if item.event.type in ("done", "error"):
                        self._announced.add(item.assistant_message_id)
                    yield item
            await self._settle_path(turns)
            yield self._done()
        finally:
            with anyio.CancelScope(shield=True):
                await self._stop_all()

    def _done(self, status: str = "complete") -> CompareDone:
        return CompareDone(tuple({"assistant_message_id": t.assistant_id, "model": t.model, "status": _status(t)}
                                 for t in self.lanes), status)

    async def stopped_events(self) -> list[TurnEvent]:
        """After Stop cancelled the whole comparison: the `done` of each reply not yet told, then its own."""
        told = [LaneEvent(t.assistant_id, await self._stopped_done(t)) for t in self.lanes
                if t.assistant_id not in self._announced]
        return [*told, self._done("interrupted")]

    async def _settle_path(self, turns: Turns) -> None:
        """The first model stored nothing: the first reply that was stored is current; none was: the
        message goes back, as a failed send's does."""
        first = self.first
        if first.outcome is Outcome.SAVED:
            return
        stored = next((t for t in self.lanes if t.outcome is Outcome.SAVED), None)
        if stored is None:
            if all(t.outcome is Outcome.ROLLED_BACK for t in self.lanes):
                await turns.roll_back(first)
            return
        await first.store.update(first.conv_id, lambda c: branches.switch(c, stored.assistant_id, descend=False),
                                 lock=self.claim.lock)

    def info(self) -> list[dict]:
        """`Conversation.turn.compare`: the replies being written, in the order the models were given."""
        return [{"assistant_message_id": t.assistant_id, "model": t.model} for t in self.lanes]

    async def _make_room(self, turns: Turns) -> Compressed | None:
        """Compress once for every lane (each lane's own check then finds room, or warns)."""
        first = self.first
        conv = await first.store.get(first.conv_id)
        if context.project(conv, await first.store.read_memory(), turns.settings) <= context.budget_of(conv, turns.settings):
            return None
        if first.opening is not None:
            await asyncio.shield(first.opening)
        outcome = await turns.compress(first.store, first.conv_id, pending=True, lock=self.claim.lock)
        return Compressed(outcome) if outcome["folded"] or outcome["dropped"] else None

    async def _drive(self, turns: Turns, lane: Turn, queue: asyncio.Queue) -> None:
        """One lane to its end; a lane stopped alone still says how it ended."""
        ended = False
        try:
            with self._scopes[lane.assistant_id]:
                async with contextlib.aclosing(turns.run(lane)) as events:
                    async for event in events:
                        if event.type == "start":
                            continue  # the comparison's own start named every reply
                        ended = ended or event.type in ("done", "error")
                        await queue.put(LaneEvent(lane.assistant_id, event))
            if not ended:
                with anyio.CancelScope(shield=True):
                    await queue.put(LaneEvent(lane.assistant_id, await self._stopped_done(lane)))
        finally:
            queue.put_nowait(lane)

    async def _stopped_done(self, lane: Turn):
        stored = None
        with contextlib.suppress(NotFound):
            conv = await lane.store.get(lane.conv_id)
            stored = next((m for m in branches.path_items(conv) + (conv.get("off_path") or [])
                           if m["id"] == lane.assistant_id), None)
        return done_event(lane.assistant_id, stored, "interrupted")

    async def stop_lane(self, assistant_id: str) -> None:
        """Stop one reply and wait (bounded by the hub's Stop) until it is saved; the others run on."""
        task = self._tasks.get(assistant_id)
        if task is None or task.done():
            return
        self._scopes[assistant_id].cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait([task], timeout=10)

    async def _stop_all(self) -> None:
        for assistant_id, task in self._tasks.items():
            if not task.done():
                self._scopes[assistant_id].cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=10)

    async def release(self, turns: Turns) -> None:
        """Give the conversation back once every lane has let go of it; title it like a turn would."""
        for lane in self.lanes:
            if not lane.settled:
                lane.outcome = Outcome.ABANDONED
        await self.claim.release()
        if self.outcome is Outcome.SAVED and turns.settings.auto_title:
            turns.name_soon(self.store, self.conv_id)


def _status(lane: Turn) -> str:
    if lane.outcome is Outcome.SAVED:
        return "saved"
    return "failed" if lane.outcome is Outcome.ROLLED_BACK else "empty"
