"""Where attachments' metadata and extracted text (pages) live: beside the originals under
DATA_DIR/attachments (`STORE=files`, one process) or in the conversations' Redis (`STORE=redis`,
any number of processes, nothing on their disks).

Promises:
- An attachment exists once its metadata is stored, and its pages are stored no later: a listing
  never names a file whose text cannot be read. Removing the metadata is what removes it.
- Listings come from the store each time they are asked for on Redis (one round trip for any
  number of scopes), so another server's upload or deletion is seen at once; the file store keeps
  a per-process cache, right because only one process writes its directory.
- Scope keys and attachment ids arrive validated (`Scope`, `valid_id`); they are the only parts
  of a path or key.

This module knows metadata and pages, not originals, search or HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import orjson

from chatserver.conversations.document import new_id, valid_id
from chatserver.store.files import atomic_write

if TYPE_CHECKING:
    from chatserver.store.redis import RedisStore

log = logging.getLogger("chat.attachments")


class AttachmentMeta(Protocol):
    """Each scope's attachments: their metadata (a dict with at least `id`, `created_at`) and pages."""

    async def list_many(self, scope_keys: Iterable[str]) -> dict[str, list[dict]]:
        """Each scope's metadata, oldest first."""

    async def pages(self, scope_key: str, attachment_id: str) -> list[dict] | None:
        """The attachment's pages; None when it is gone."""

    async def put(self, scope_key: str, meta: dict, pages: list[dict]) -> None:
        """Store (or replace) one attachment's metadata and pages."""

    async def delete(self, scope_key: str, attachment_id: str) -> bool:
        """Remove one attachment; whether it was there."""

    async def delete_scope(self, scope_key: str) -> None:
        """Remove every attachment of a scope."""

    def scope_keys(self) -> AsyncIterator[str]:
        """Every scope holding attachments (a migration walks them)."""


def sort_metas(metas: list[dict]) -> list[dict]:
    metas.sort(key=lambda m: (m.get("created_at", ""), m.get("id", "")))
    return metas


# -- files -------------------------------------------------------------------------------------

class FileMeta:
    """`<root>/<scope key>/<id>/meta.json` and `pages.json`, written pages first: `meta.json`
    appearing is the attachment appearing. A deleted attachment's directory is renamed away first
    (originals kept there by the file blob store go with it), so no reader meets half of it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._metas: dict[str, list[dict]] = {}

    def _dir(self, scope_key: str) -> Path:
        return self.root / scope_key

    async def list_many(self, scope_keys: Iterable[str]) -> dict[str, list[dict]]:
        return {key: self._list(key) for key in scope_keys}

    def _list(self, scope_key: str) -> list[dict]:
        cached = self._metas.get(scope_key)
        if cached is not None:
            return cached
        metas = []
        directory = self._dir(scope_key)
        if directory.is_dir():
            for entry in directory.iterdir():
                if not valid_id(entry.name):
                    continue
                try:
                    metas.append(orjson.loads((entry / "meta.json").read_bytes()))
                except FileNotFoundError:
                    continue  # an upload still being written (or one a crash left for the sweep)
                except (OSError, orjson.JSONDecodeError) as exc:
                    log.error("skipping attachment %s/%s: %s", scope_key, entry.name, exc)
        self._metas[scope_key] = sort_metas(metas)
        return metas

    async def pages(self, scope_key: str, attachment_id: str) -> list[dict] | None:
        try:
            return orjson.loads(await asyncio.to_thread((self._dir(scope_key) / attachment_id / "pages.json").read_bytes))
        except FileNotFoundError:
            return None

    async def put(self, scope_key: str, meta: dict, pages: list[dict]) -> None:
        await asyncio.to_thread(self._put, self._dir(scope_key) / meta["id"], meta, pages)
        self._metas.pop(scope_key, None)

    @staticmethod
    def _put(directory: Path, meta: dict, pages: list[dict]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write(directory / "pages.json", orjson.dumps(pages))
        atomic_write(directory / "meta.json", orjson.dumps(meta))
        _fsync_dir(directory.parent)

    async def delete(self, scope_key: str, attachment_id: str) -> bool:
        target = self._dir(scope_key) / attachment_id
        doomed = self._dir(scope_key) / f".deleting-{attachment_id}"
        self._metas.pop(scope_key, None)
        try:
            os.rename(target, doomed)
        except FileNotFoundError:
            return False
        await asyncio.to_thread(shutil.rmtree, doomed, True)
        return True

    async def delete_scope(self, scope_key: str) -> None:
        directory = self._dir(scope_key)
        self._metas.pop(scope_key, None)
        if directory.is_dir():
            doomed = directory.with_name(f".deleting-{directory.name}-{new_id()}")
            os.rename(directory, doomed)
            await asyncio.to_thread(shutil.rmtree, doomed, True)

    async def scope_keys(self) -> AsyncIterator[str]:
        if not self.root.is_dir():
            return
        for entry in sorted(self.root.iterdir()):
            if entry.name in ("library", "project"):
                for owner in sorted(entry.iterdir()):
                    if owner.is_dir() and not owner.name.startswith("."):
                        yield f"{entry.name}/{owner.name}"
            elif valid_id(entry.name) and entry.is_dir():
                yield entry.name


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- Redis -------------------------------------------------------------------------------------

# The scope's hash and the pages keys of its attachments go in one step.
DELETE_SCOPE = """
local ids = redis.call('HKEYS', KEYS[1])
for _, id in ipairs(ids) do redis.call('DEL', ARGV[1] .. id) end
redis.call('DEL', KEYS[1])
return #ids
"""


class RedisMeta:
    """On the conversations' Redis, under its prefix: `att:<scope key>` a hash of attachment id ->
    metadata JSON, and `attpages:<scope key>/<id>` each attachment's pages (JSON). Written pages
    first, in one MULTI; nothing is cached in the process."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self.redis = store.redis
        self.prefix = store.prefix
        self._delete_scope = self.redis.register_script(DELETE_SCOPE)

    def _scope_key(self, scope_key: str) -> str:
        return f"{self.prefix}att:{scope_key}"

    def _pages_key(self, scope_key: str, attachment_id: str) -> str:
        return f"{self.prefix}attpages:{scope_key}/{attachment_id}"

    async def list_many(self, scope_keys: Iterable[str]) -> dict[str, list[dict]]:
        keys = list(dict.fromkeys(scope_keys))
        if not keys:
            return {}
        with self.store.reachable():
            async with self.redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hvals(self._scope_key(key))
                answers = await pipe.execute()
        return {key: sort_metas([orjson.loads(v) for v in values]) for key, values in zip(keys, answers)}

    async def pages(self, scope_key: str, attachment_id: str) -> list[dict] | None:
        with self.store.reachable():
            raw = await self.redis.get(self._pages_key(scope_key, attachment_id))
        return None if raw is None else orjson.loads(raw)

    async def put(self, scope_key: str, meta: dict, pages: list[dict]) -> None:
        with self.store.reachable():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.set(self._pages_key(scope_key, meta["id"]), orjson.dumps(pages))
                pipe.hset(self._scope_key(scope_key), meta["id"], orjson.dumps(meta))
                await pipe.execute()

    async def delete(self, scope_key: str, attachment_id: str) -> bool:
        with self.store.reachable():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hdel(self._scope_key(scope_key), attachment_id)
                pipe.delete(self._pages_key(scope_key, attachment_id))
                removed, _ = await pipe.execute()
        return bool(removed)

    async def delete_scope(self, scope_key: str) -> None:
        with self.store.reachable():
            await self._delete_scope(keys=[self._scope_key(scope_key)],
                                     args=[f"{self.prefix}attpages:{scope_key}/"])

    async def scope_keys(self) -> AsyncIterator[str]:
        cut = len(self.prefix) + len("att:")
        with self.store.reachable():
            found = sorted({key.decode()[cut:] async for key in self.redis.scan_iter(
                match=f"{self.prefix}att:*", count=500)})
        for key in found:
            yield key

