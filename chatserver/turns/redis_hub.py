"""Running turns shared by every server process on one Redis (STORE=redis).

A turn runs in the process that began it, exactly as in `turn_hub.LocalTurnHub`, whose log in
memory still serves that process's own streams (the POST that started the turn follows it from
event 1 without a round trip). On top of it:
- every frame is copied to the conversation's event stream in Redis (`append_turn_event`: seq =
  the frame's SSE id, turn id = the reply's message id), so `follow` on any process replays and
  follows the turn exactly once. The copy's last event is written once the turn has saved and let
  the conversation go, and stays readable KEEP_AFTER_END seconds more;
- the process listens to the conversation's stop channel for the turn's lifetime, so `stop` on
  any process (`publish_stop`) cancels the turn where it runs, as a local stop does; the process
  that asked answers once the turn has let go (bounded by STOP_WAIT), its reply saved by then;
- it also listens to each reply's own stop channel (a comparison's replies, a lone turn's one),
  so `stop_reply` on any process stops that reply where it runs, as a local `stop_reply` does;
  the process that asked answers once the reply is saved or the turn let go (bounded by STOP_WAIT);
- `info` reads the lock and the latest event kept in Redis for a turn running elsewhere.

A process that dies mid-turn leaves its events without a last one, and its heartbeat beside the
lock stops: once MISSED_BEATS beats are missed the turn no longer runs for anyone. A follower
elsewhere (it asks whenever a wait brings nothing) then ends with a `done` of status `interrupted`,
Stop answers at once, the list shows no stream, the next turn takes the lock over, and the store
reads the last checkpoint as interrupted (`RedisOwnerStore.get`).

This module knows the hub protocol and the store's turn-event calls, not HTTP or wire formats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from chatserver import tasks
from chatserver.api.sse import encode
from chatserver.store.files import StoreUnavailable
from chatserver.store.person_events import PersonEvents, tell_turn
from chatserver.store.redis import RedisStore
from chatserver.turns.compare import Comparison
from chatserver.turns.hub import KEEP_AFTER_END, STOP_WAIT, LocalTurnHub, RunningTurn
from chatserver.turns.pipeline import Turn, Turns
from chatserver.turns.reply import done_event

log = logging.getLogger("chat.redis_turn_hub")

# How long the copy of a turn's events keeps retrying one append while Redis is away.
COPY_RETRY_SECONDS = 30.0
# The longest single wait of a stopping process before it looks at the lock again.
STOP_POLL_MS = 250
# How long shutdown waits for the last copies to reach Redis.
CLOSE_WAIT = 5.0


class RedisTurnHub:
    """Turns of this process, mirrored to Redis; turns of other processes, read from it."""

    def __init__(self, turns: Turns, store: RedisStore, events: PersonEvents | None = None) -> None:
        self.local = LocalTurnHub(turns, events)
        self.store = store
        self._helpers: set[asyncio.Task] = set()  # per turn: its copy to Redis, its stop listener, its note
        self._sweeper = asyncio.create_task(self._tell_dead_turns(), name="dead turn sweeper")

    def start(self, turn: Turn | Comparison) -> RunningTurn:
        running = self.local.start(turn)
        helpers = [(self._copy(running), "copy"), (self._listen_for_stop(running), "stop listener"),
                   (self._noted(running), "note")]
        # A reply's own Stop: one reply of a comparison, or a lone turn's reply (which stops it whole).
        helpers += [(self._listen_for_stop(running, reply.assistant_id), f"reply {reply.assistant_id} stop listener")
                    for reply in (turn.lanes if isinstance(turn, Comparison) else [turn])]
        for work, name in helpers:
            task = asyncio.create_task(work, name=f"turn {turn.conv_id} {name}")
            self._helpers.add(task)
            task.add_done_callback(self._helpers.discard)
        return running

    async def info(self, conv_id: str) -> dict | None:
        if (running := self.local.running(conv_id)) is not None:
            return running.info()
        locked, tail = await self.store.turn_state(conv_id)
        if not locked or tail is None or tail.last:
            return None
        return {"assistant_message_id": tail.turn_id, "events": tail.seq}

    async def follow(self, conv_id: str, after: int) -> AsyncIterator[bytes] | None:
        if self.local.running(conv_id) is not None:
            return await self.local.follow(conv_id, after)
        # A turn that ended here may have been followed by another one elsewhere: Redis knows which is latest.
        locked, tail = await self.store.turn_state(conv_id)
        if tail is None or (tail.seq <= after and (tail.last or not locked)):
            return None
        return self._follow_redis(conv_id, after, tail.turn_id)

    async def _follow_redis(self, conv_id: str, after: int, turn_id: str) -> AsyncIterator[bytes]:
        async def still_running() -> bool:
            return await self.store.turn_locked(conv_id)

        seq = after
        async with contextlib.aclosing(self.store.read_turn_events(
                conv_id, after, turn_id=turn_id, still_running=still_running)) as events:
            async for seq, frame in events:
                if frame:  # an empty last event only marks the end of a turn that ended without one
                    yield frame
        locked, tail = await self.store.turn_state(conv_id)
        if not locked and tail is not None and tail.turn_id == turn_id and not tail.last:
            # Its process stopped beating before the last event: end the stream as a Stop would.
            log.warning("the turn on %s stopped beating; its followers end it as interrupted", conv_id)
            stored = await self.store.stored_reply(conv_id, turn_id)
            if (frame := encode(done_event(turn_id, stored, "interrupted"), max(seq, tail.seq) + 1)) is not None:
                yield frame

    async def stop(self, conv_id: str) -> None:
        if self.local.running(conv_id) is not None:
            await self.local.stop(conv_id)
            return
        await self._ask_to_stop(conv_id, None)

    async def stop_reply(self, conv_id: str, assistant_id: str) -> None:
        """Stop one reply of a comparison wherever it runs (a lone turn's reply stops it whole);
        answer once that reply is saved or the turn let go. An id of no running reply costs STOP_WAIT
        here: only the process running the turn knows its replies."""
        if self.local.running(conv_id) is not None:
            await self.local.stop_reply(conv_id, assistant_id)
            return
        await self._ask_to_stop(conv_id, assistant_id)

    async def _ask_to_stop(self, conv_id: str, assistant_id: str | None) -> None:
        """Publish the Stop (of one reply, given its id) until it is done where the turn runs, at most STOP_WAIT."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STOP_WAIT
        while True:
            locked, tail = await self.store.turn_state(conv_id)
            if not locked:
                return  # nothing runs, or the stopped turn has saved and let go
            if assistant_id is not None:
                # A reply is stored `streaming` (a checkpoint) until it ends, stopped or finished
                # before the Stop came.
                stored = await self.store.stored_reply(conv_id, assistant_id)
                if stored is not None and stored.get("status") != "streaming":
                    return
            # Asked again on every wake: a process whose listener was not live yet hears a later one.
            await self.store.publish_stop(conv_id, assistant_id)
            remaining = deadline - loop.time()
            if remaining <= 0:
                log.warning("%s on %s did not stop within %s s of Stop",
                            "the turn" if assistant_id is None else f"reply {assistant_id} of the turn", conv_id, STOP_WAIT)
                return
            # Any new event wakes this: a reply's `done` comes once it is saved, the turn's last one
            # once it let the conversation go.
            await self.store.wait_turn_event(conv_id, tail.seq if tail is not None else 0,
                                             block_ms=max(1, min(int(remaining * 1000), STOP_POLL_MS)))

    async def close(self) -> None:
        await tasks.stop(self._sweeper)
        await self.local.close()
        if self._helpers:
            await asyncio.wait(list(self._helpers), timeout=CLOSE_WAIT)
        for task in list(self._helpers):
            task.cancel()

    async def _noted(self, running: RunningTurn) -> None:
        """While the turn runs, it is in the store's list of running turns (for `_tell_dead_turns`)."""
        turn = running.turn
        note = (running.conv_id, turn.store.owner, turn.assistant_id)
        try:
            await self.store.note_running(*note)
            await asyncio.wait([running.task])
            await self.store.forget_running(*note)
        except StoreUnavailable:
            pass  # a note left behind is taken out by the next sweep, once the lock is gone

    async def _tell_dead_turns(self) -> None:
        """Every beat: a turn whose process stopped beating ends for its owner's pages (their list's dot clears).

        The store answers each dead turn to one process only, so its pages hear of it once.
        """
        while True:
            await asyncio.sleep(self.store.renew_seconds)
            try:
                for owner, conv_id in await self.store.take_dead_turns():
                    log.warning("the turn on %s stopped beating (its server is gone); telling its pages", conv_id)
                    tell_turn(self.local.events, owner, conv_id, started=False)
            except StoreUnavailable:
                continue
            except Exception:
                log.exception("looking for turns whose server is gone failed; looking again at the next beat")

    async def _listen_for_stop(self, running: RunningTurn, assistant_id: str | None = None) -> None:
        """Until the turn ends: a Stop published by any process stops it here (only its reply
        `assistant_id` of a comparison, given one)."""
        try:
            async with self.store.subscribe_stop(running.conv_id, assistant_id) as stopped:
                asked = asyncio.ensure_future(stopped.wait())
                try:
                    await asyncio.wait([asked, running.task], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    asked.cancel()
                if stopped.is_set():
                    await (running.stop() if assistant_id is None else running.stop_reply(assistant_id))
        except StoreUnavailable as exc:
            log.warning("the turn on %s cannot hear a Stop from other processes: %s", running.conv_id, exc)

    async def _copy(self, running: RunningTurn) -> None:
        """Append the turn's frames to Redis as they come; its last one once the turn has let go."""
        frames, conv_id, turn_id = running.log, running.conv_id, running.turn.assistant_id
        sent, closed = 0, False
        try:
            while not closed:
                ended, count = frames.ended, len(frames.frames)
                # The final frame (`done`/`error`) waits for the end: whoever reads it may start the next turn.
                upto = count if ended or not running.finished else count - 1
                while sent < upto:
                    closed = ended and sent + 1 == count
                    await self._append(conv_id, turn_id, sent + 1, frames.frames[sent], closed)
                    sent += 1
                if ended and not closed:
                    await self._append(conv_id, turn_id, sent + 1, b"", True)  # it ended without a last event
                    closed = True
                if not closed:
                    await frames.wait_past(count if running.finished else sent)
                    # Woken with this process's own streams: let them send the new frame before Redis is asked.
                    await asyncio.sleep(0)
        except StoreUnavailable as exc:
            log.warning("the events of the turn on %s stopped reaching Redis: %s", conv_id, exc)
        except Exception:
            log.exception("copying the events of the turn on %s to Redis failed", conv_id)

    async def _append(self, conv_id: str, turn_id: str, seq: int, frame: bytes, last: bool) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + COPY_RETRY_SECONDS
        delay = 0.1
        while True:
            try:
                await self.store.append_turn_event(conv_id, turn_id, seq, frame, last=last,
                                                   keep_seconds=KEEP_AFTER_END)
                return
            except StoreUnavailable:
                if loop.time() >= deadline:
                    raise
                await asyncio.sleep(delay)  # Redis is away: try the same seq again shortly (appends are idempotent)
                delay = min(delay * 2, 2.0)
