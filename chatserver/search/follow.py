"""Search that follows the store: the index is brought in line with every conversation at start-up
(in the background, so a server that ran without it, or crashed before its last index write,
still finds everything), then kept in step by the store's `changes()` feed, on the file store and
on Redis alike: a change made by any process reaches every process's index within about a second.
Nothing is re-indexed on a search's path.

While the start-up catch-up runs, `state` is "building" (/healthz says so) and a search waits for
it at most BUILD_WAIT seconds, then is refused with `StillBuilding` (503, try again shortly)
rather than answering from a partial index as if it were whole."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from pathlib import Path

from chatserver.search.index import IndexFollower, SearchIndex
from chatserver.store.files import NotFound, OwnerStore, Store, StoreChange

log = logging.getLogger("chat.search")

# How long a search waits for the start-up catch-up before it is refused as still building.
BUILD_WAIT = 5.0


class StillBuilding(Exception):
    """The index is still being built from the store; `read` conversations read so far."""

    def __init__(self, read: int) -> None:
        super().__init__(f"the search index is still being built ({read} conversations read so far)")
        self.read = read


class FollowedSearch:
    def __init__(self, store: Store, index: SearchIndex) -> None:
        self.store, self.index = store, index
        self.follower = IndexFollower(index)
        self.ready: asyncio.Task | None = None
        self._following: asyncio.Task | None = None
        self.read = 0  # conversations the catch-up has read so far

    @property
    def state(self) -> str:
        """The start-up catch-up: "building" while it runs, "ready" once done, "failed" if it broke."""
        if self.ready is None or not self.ready.done():
            return "building"
        if self.ready.cancelled() or self.ready.exception() is not None:
            return "failed"
        return "ready"

    async def start(self) -> None:
        await self.index.open()
        feed = await self.store.changes()  # subscribed first: what changes during the catch-up is told after it
        self.ready = ready = asyncio.create_task(self._catch_up())
        ready.add_done_callback(_log_failure)
        self._following = asyncio.create_task(self._follow(feed, ready))

    async def _catch_up(self) -> None:
        convs = []
        async for conv in self.store.every_conversation():
            convs.append(conv)
            self.read += 1
        pairs = [(conv["owner"], conv) for conv in convs]
        await (self.index.reconcile(pairs) if await self.index.is_built() else self.index.rebuild(pairs))
        self.follower.seen_all(convs)

    async def _follow(self, feed: AsyncGenerator[StoreChange, None], ready: asyncio.Task) -> None:
        await asyncio.shield(ready)
        async with contextlib.aclosing(feed):
            async for change in feed:
                try:
                    await self._apply(change)
                except Exception:
                    log.exception("the search index missed a change of %s", change.conv_id)

    async def _apply(self, change: StoreChange) -> None:
        if change.deleted:
            self.follower.removed(change.owner, change.conv_id)
            return
        if change.streaming:
            return  # a reply still being written is indexed once, when it is saved
        conv = change.conv
        if conv is None:
            try:
                conv = await self.store.for_owner(change.owner).get(change.conv_id)
            except NotFound:
                return  # deleted since: its own change follows
        self.follower.changed(change.owner, conv)

    async def search(self, store: OwnerStore, q: str, limit: int) -> list[dict]:
        if self.ready is not None and not self.ready.done():  # the start-up catch-up, waited for a while
            await asyncio.wait([self.ready], timeout=BUILD_WAIT)
            if not self.ready.done():
                raise StillBuilding(self.read)
        if self.ready is not None:
            self.ready.result()  # a catch-up that broke says so on every search (the log has its traceback)
        return await self.index.search(store.owner, q, limit)

    async def close(self) -> None:
        for task in (self._following, self.ready):
            if task is not None:
                task.cancel()
        await self.index.close()


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("building the search index from the store failed: %r", exc, exc_info=exc)


async def open_search(store: Store, path: Path) -> FollowedSearch:
    search = FollowedSearch(store, SearchIndex(path))
    await search.start()
    return search
