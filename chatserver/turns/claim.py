"""A conversation claimed for one turn, or for a change that must not race one (compress now, a
branch switch): the one object that takes the store's turn lock, keeps it alive where locks expire
(Redis), and lets it go exactly once, even when the store is away at that moment."""

from __future__ import annotations

import asyncio
import logging

import anyio

from chatserver.store.files import OwnerStore, StoreUnavailable, TurnLock

log = logging.getLogger("chat.claim")

UNLOCK_RETRY_SECONDS = 60.0  # how long a release keeps trying while the store is away
_RETRYING: set[asyncio.Future] = set()  # releases waiting for the store to come back


class Claim:
    def __init__(self, store: OwnerStore, lock: TurnLock) -> None:
        self.store = store
        self.lock = lock
        self._keeper: asyncio.Future | None = None
        self._released = False

    @classmethod
    async def take(cls, store: OwnerStore, conv_id: str, *, keep_alive: bool = False) -> Claim:
        """Claim the conversation (TurnBusy while a turn holds it). `keep_alive`: renew the lock for
        as long as the claim lasts (a turn; a short change finishes well inside the lock's expiry)."""
        claim = cls(store, await store.lock_turn(conv_id))
        if keep_alive and store.lock_renew_seconds is not None:
            claim._keeper = asyncio.ensure_future(claim._keep(store.lock_renew_seconds))
        return claim

    async def __aenter__(self) -> Claim:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()

    async def _keep(self, every: float) -> None:
        """Renew the lock while the turn runs; a process that dies stops renewing, and the lock frees."""
        while True:
            await asyncio.sleep(every)
            try:
                if not await self.store.renew_turn(self.lock):
                    log.warning("turn on %s lost its lock; its writes will be refused", self.lock.conv_id)
                    return
            except StoreUnavailable:
                continue  # the turn itself reports the store; the lock lasts a while yet

    async def release(self) -> None:
        """Give the conversation back (once; later calls do nothing). Shielded: Stop and closed tabs
        release from a cancelled task. With the store away, the release is retried until it is back."""
        if self._released:
            return
        self._released = True
        if self._keeper is not None:
            self._keeper.cancel()
        with anyio.CancelScope(shield=True):
            try:
                await self.store.unlock_turn(self.lock)
            except StoreUnavailable:
                retry = asyncio.ensure_future(self._unlock_when_back())
                _RETRYING.add(retry)
                retry.add_done_callback(_RETRYING.discard)

    async def _unlock_when_back(self) -> None:
        """Release once the store answers again, rather than leave the conversation busy until the
        lock expires (bounded by UNLOCK_RETRY_SECONDS: by then it has expired)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + UNLOCK_RETRY_SECONDS
        delay = 0.1
        while loop.time() < deadline:
            await asyncio.sleep(delay)
            try:
                await self.store.unlock_turn(self.lock)
                return
            except StoreUnavailable:
                delay = min(delay * 2, 2.0)
