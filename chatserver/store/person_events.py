"""What a person's open pages are told: one event stream per signed-in person (`GET /api/events`).

Three events, for that person's conversations only:
- `conversation`: `{"id", ...changed fields}`: a new conversation, a rename, a title, a pin, an
  archive, a message (the list entry's fields), or `streaming` turning on or off;
- `deleted`: `{"id"}`;
- `turn`: `{"id", "state": "started"|"ended"}`.

`AnnouncingStore` wraps one owner's store (the one `deps` hands every route), so every change a
route or a turn makes is told from one place, whichever store is behind it; the turn hub tells
when a turn starts and ends (`tell_turn`). `PersonEvents`
delivers within this process; `RedisPersonEvents` sends each event through Redis
publish/subscribe, so a change made by any process reaches the pages connected to any other.

Events are for pages that are open now: nothing is kept for a page that connects later (it reads
the list when it connects), and a follower that falls `FOLLOWER_BACKLOG` events behind is dropped
(its browser reconnects and reads the list again). This module knows stores and Redis channels,
not routes or wire formats upstream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager, suppress
from typing import Any

import orjson

from chatserver import metrics, tasks
from chatserver.conversations.document import summary_of
from chatserver.store.files import Change, OwnerStore, StoreUnavailable, TurnLock

log = logging.getLogger("chat.person_events")

FOLLOWER_BACKLOG = 1000  # events a follower may fall behind before it is dropped
RESUBSCRIBE_DELAY = 1.0  # seconds between two attempts to subscribe while Redis is away

Event = tuple[str, dict]


class Follower:
    """One open page's events, in order; ends (the page reconnects and reads the list) once it falls behind."""

    def __init__(self) -> None:
        self._events: deque[Event] = deque()
        self._grew = asyncio.Event()
        self.overflowed = False

    def put(self, event: Event) -> None:
        if len(self._events) >= FOLLOWER_BACKLOG:
            self.overflowed = True
        else:
            self._events.append(event)
        self._grew.set()

    async def __aiter__(self) -> AsyncIterator[Event]:
        while not self.overflowed:
            if not self._events:
                self._grew.clear()
                await self._grew.wait()
                continue
            yield self._events.popleft()


class PersonEvents:
    """Events of one process, delivered to the followers connected to it."""

    def __init__(self) -> None:
        self._followers: dict[str, set[Follower]] = {}

    def publish(self, owner: str, name: str, data: dict) -> None:
        """Tell every page of `owner` (never waits: a change is not held up by its telling)."""
        self.deliver(owner, (name, data))

    def deliver(self, owner: str, event: Event) -> None:
        for follower in self._followers.get(owner, ()):
            follower.put(event)

    @asynccontextmanager
    async def follow(self, owner: str) -> AsyncIterator[Follower]:
        follower = Follower()
        self._followers.setdefault(owner, set()).add(follower)
        try:
            await self.ready()
            yield follower
        finally:
            followers = self._followers.get(owner)
            if followers is not None:
                followers.discard(follower)
                if not followers:
                    del self._followers[owner]

    async def ready(self) -> None:
        """Return once events published from now on reach this process's followers."""

    async def close(self) -> None:
        """Stop delivering."""


class RedisPersonEvents(PersonEvents):
    """Every process publishes to `<prefix>person:<owner>`; one PSUBSCRIBE per process fans them out."""

    def __init__(self, redis: Any, prefix: str, subscribe_timeout: float = 5.0) -> None:
        super().__init__()
        self.redis = redis
        self.channel_prefix = f"{prefix}person:".encode()
        self.subscribe_timeout = subscribe_timeout
        self._live = asyncio.Event()
        self._listener: asyncio.Task | None = None
        # Publishes go out in order, one at a time, from one task: a change never waits for Redis.
        self._outbox: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue(10_000)
        self._sender: asyncio.Task | None = None

    def publish(self, owner: str, name: str, data: dict) -> None:
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send(), name="person events sender")
        try:
            self._outbox.put_nowait((self.channel_prefix + owner.encode(), orjson.dumps([name, data])))
        except asyncio.QueueFull:
            log.warning("Redis is not taking person events; dropped one for a page to catch up on reconnect")

    async def _send(self) -> None:
        while True:
            channel, message = await self._outbox.get()
            try:
                await self.redis.publish(channel, message)
            except Exception as exc:  # Redis away: the pages read the list again when they reconnect
                log.warning("could not publish a person event: %s", exc)

    async def ready(self) -> None:
        if self._listener is None or self._listener.done():
            self._listener = asyncio.create_task(self._listen(), name="person events listener")
        try:
            await asyncio.wait_for(self._live.wait(), self.subscribe_timeout)
        except asyncio.TimeoutError:
            raise StoreUnavailable("Redis is unreachable: live updates are not available") from None

    async def _listen(self) -> None:
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.psubscribe(self.channel_prefix + b"*")
                while True:
                    # A bounded wait, not a blocking read: an idle subscription must not trip the
                    # client's socket timeout, and a dead connection must surface.
                    message = await pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    if message["type"] == "psubscribe":
                        self._live.set()
                    elif message["type"] == "pmessage":
                        owner = message["channel"][len(self.channel_prefix):].decode()
                        name, data = orjson.loads(message["data"])
                        self.deliver(owner, (name, data))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._live.clear()
                log.warning("the person events subscription failed (%s); subscribing again", exc)
                await asyncio.sleep(RESUBSCRIBE_DELAY)
            finally:
                with suppress(Exception):
                    await pubsub.aclose()

    async def close(self) -> None:
        for task in (self._listener, self._sender):
            await tasks.stop(task)


def tell_turn(events: PersonEvents, owner: str, conv_id: str, started: bool) -> None:
    """A turn took the conversation (`started`) or let it go: its `turn` event and the list's dot."""
    events.publish(owner, "turn", {"id": conv_id, "state": "started" if started else "ended"})
    events.publish(owner, "conversation", {"id": conv_id, "streaming": started})


class AnnouncingStore:
    """One owner's store that tells the owner's pages of each change it makes (see the module doc)."""

    def __init__(self, inner: OwnerStore, events: PersonEvents) -> None:
        self.inner = inner
        self.events = events
        self.owner = inner.owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # reads and the rest pass through unchanged

    def _tell(self, name: str, data: dict) -> None:
        self.events.publish(self.owner, name, data)

    async def create(self, conv: dict) -> dict:
        created = await self.inner.create(conv)
        self._tell("conversation", summary_of(created))
        return created

    async def update_soon(self, conv_id: str, change: Change, *,
                          lock: TurnLock | None = None) -> tuple[dict, Awaitable[None]]:
        conv, written = await self.inner.update_soon(conv_id, change, lock=lock)
        self._tell("conversation", summary_of(conv))
        return conv, written

    async def get(self, conv_id: str) -> dict:
        began = time.monotonic()
        conv = await self.inner.get(conv_id)
        metrics.active.store_seconds.labels("get").observe(time.monotonic() - began)
        return conv

    async def update(self, conv_id: str, change: Change, *, lock: TurnLock | None = None) -> dict:
        began = time.monotonic()
        conv = await self.inner.update(conv_id, change, lock=lock)
        metrics.active.store_seconds.labels("update").observe(time.monotonic() - began)
        self._tell("conversation", summary_of(conv))
        return conv

    async def delete(self, conv_id: str) -> None:
        await self.inner.delete(conv_id)
        self._tell("deleted", {"id": conv_id})
