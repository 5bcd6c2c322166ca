"""The store protocol (storage.Store / OwnerStore) on Redis, for any number of server processes.

Layout, all keys under one prefix (`chat:` by default):
- `conv:<id>` a hash: `head` (the conversation's JSON without its message lists, which keep their
  place as nulls so the key order survives), `lists` (which fields are lists), `owner`, `version`
  (bumped by every write), `summary` (the list entry, so listing never loads messages), `nonce`
  (the last write's id, so a write retried after a lost reply is recognised, not applied twice).
- `conv:<id>:messages`, `conv:<id>:archive`: one JSON document per item. A write RPUSHes the new
  items after the unchanged ones (LTRIMming first when an item near the end changed), so a turn
  appends to a long history instead of rewriting it.
- `owner:<owner>:conversations` a sorted set of ids scored by update time; ids whose hash expired
  are dropped when the list meets them.
- `lock:<id>` the turn lock (`<fence>:<token>`, SET NX PX, renewed by the running turn) and
  `fence:<id>` a counter bumped by every lock and unlock: a write carrying a lock whose fence is
  not the current one is refused (LockLost), so a paused process never overwrites a newer turn.
- `beat:<id>` the running turn's heartbeat beside its lock, set again with every renewal (each
  HEARTBEAT_SECONDS) and gone MISSED_BEATS beats after the last: a lock without it belongs to a
  process that stopped answering, so the turn reads as not running and the next turn takes the
  lock over (its new fence refuses the silent process's writes, should it wake).
- `running` a hash of the turns running in any process (conv id -> `<owner>:<turn id>`), so the
  process that first sees one whose heartbeat stopped tells its owner's pages it ended.
- `memory:<owner>`, `models`, and `kv:<key>` (small JSON values for other modules: accounts, sessions).
- `presets:<owner>`, `projects:<owner>`, `shares:<owner>`: each person's small documents
  (OWNER_DOCUMENTS), and `share:<share id>` a shared snapshot, read without an owner.
- `stop:<id>` a pub/sub channel: Stop from any process reaches the process running the turn;
  `stop:<id>:<reply id>` stops one reply of a comparison.
- `events:<id>` a stream of the running turn's events (ids `0-<seq>`), so a re-attach on any
  process replays and follows them; it expires shortly after the turn's last event.

Every write is one Lua script: checked against the version it was computed from and applied whole,
or not at all. Within one process the writes to one conversation are queued in the order they are
made; across processes a write computed from an older version is retried on the newer one, so a
`change` may run more than once and must only depend on the conversation it is given.
Reads are one round trip: the script sends the lists only when the cached version is stale.

Redis unreachable (or still loading its data after a restart) raises StoreUnavailable; the client
reconnects by itself once it answers again. Durability is Redis's: run it with `appendonly yes`
and `appendfsync everysec` (a write is in the AOF before Redis acknowledges it, so a killed Redis
loses nothing acknowledged; a lost machine loses at most the last second).

Scripts touch keys they derive from the prefix, so this needs one Redis (or a primary), not a Cluster.
This module knows Redis and the store protocol, not turns, routes or wire formats.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import urlsplit, urlunsplit

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

from chatserver import tasks
from chatserver.conversations.document import (
    new_id,
    now_iso,
    recover_interrupted,
    streaming_replies,
    summary_of,
    upgrade,
    valid_id,
)
from chatserver.store.files import (
    OWNER_DOCUMENTS,
    SEALED_LISTS,
    SEGMENT_MESSAGES,
    SHARE_ID,
    Change,
    LockLost,
    NotFound,
    StoreChange,
    StoreUnavailable,
    TurnBusy,
    TurnLock,
    _check_owner,
    check_document,
    check_share_id,
    is_checkpoint,
    place_replies,
)
from chatserver.upstream.failures import redact_json

log = logging.getLogger("chat.redis_store")

LISTS = tuple(SEALED_LISTS)  # the fields that only grow at their end: stored as Redis lists
KV_KEY = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
# How often a write computed from a version another process replaced meanwhile is recomputed.
MAX_ATTEMPTS = 50
# The changes stream keeps about this many changes; each process's search follows it.
CHANGES_KEPT = 10_000
CHANGES_BLOCK_MS = 1000  # one XREAD waits this long for a change before asking again
CHANGES_RETRY_SECONDS = 1.0  # between two attempts while Redis is away
RECHECK = SEGMENT_MESSAGES  # the newest stored items a write checks for edits in place
CACHED_CONVERSATIONS = 1000
EVENTS_TTL_MS = 3_600_000  # a turn's event stream outlives its latest event by this much at most
# Heartbeats a running turn may miss before other processes take its process for dead.
MISSED_BEATS = 3
SUBSCRIBE_TIMEOUT = 3.0  # seconds a turn waits for the stop subscription before calling Redis unreachable
RESUBSCRIBE_DELAY = 0.1

# Script answers below zero.
CONFLICT, GONE, STALE_LOCK, BUSY = -1, -2, -3, -4


@dataclass(frozen=True, slots=True)
class FencedTurnLock(TurnLock):
    """A turn lock that also carries its acquisition's fence number."""

    fence: int = 0

    @property
    def value(self) -> str:
        return f"{self.fence}:{self.token}"


# KEYS: conv hash, messages, archive, owner index, fence, changes. ARGV: expected version ("" = any,
# for create), fence ("" = no lock), nonce, owner, head, summary, score, ttl ms ("0" = none), lists,
# conv id, "1" for a checkpoint (else "0"), then per list: how many stored items to keep (-1 all,
# -2 none: not a list), count, the items. The change is told on the changes stream in the same step.
WRITE = """
local h = KEYS[1]
if ARGV[1] ~= '' then
  local cur = redis.call('HMGET', h, 'version', 'nonce', 'owner')
  if not cur[1] or cur[3] ~= ARGV[4] then return -2 end
  if cur[1] ~= ARGV[1] then
    if cur[2] == ARGV[3] then return tonumber(cur[1]) end
    return -1
  end
end
if ARGV[2] ~= '' and redis.call('GET', KEYS[5]) ~= ARGV[2] then return -3 end
local version = redis.call('HINCRBY', h, 'version', 1)
redis.call('HSET', h, 'head', ARGV[5], 'owner', ARGV[4], 'summary', ARGV[6], 'nonce', ARGV[3], 'lists', ARGV[9])
redis.call('XADD', KEYS[6], 'MAXLEN', '~', CHANGES_KEPT, '*', 'o', ARGV[4], 'c', ARGV[10], 's', ARGV[11])
local i = 12
for k = 2, 3 do
  local keep, n = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  i = i + 2
  if keep == 0 or keep == -2 then redis.call('DEL', KEYS[k])
  elseif keep > 0 then redis.call('LTRIM', KEYS[k], 0, keep - 1) end
  for s = i, i + n - 1, 1000 do
    redis.call('RPUSH', KEYS[k], unpack(ARGV, s, math.min(s + 999, i + n - 1)))
  end
  i = i + n
end
redis.call('ZADD', KEYS[4], ARGV[7], ARGV[10])
for k = 1, 3 do
  if ARGV[8] ~= '0' then redis.call('PEXPIRE', KEYS[k], ARGV[8]) else redis.call('PERSIST', KEYS[k]) end
end
if ARGV[8] ~= '0' then redis.call('PEXPIRE', KEYS[5], ARGV[8]) end
return version
"""

# KEYS: conv hash, messages, archive, owner index. ARGV: cached version, owner ("" = any), conv id.
# Answers false (gone or another owner's), {version} (the cache is current) or the whole conversation.
LOAD = """
local cur = redis.call('HMGET', KEYS[1], 'version', 'owner', 'head', 'lists')
if not cur[1] then
  if KEYS[4] ~= '' then redis.call('ZREM', KEYS[4], ARGV[3]) end
  return false
end
if ARGV[2] ~= '' and cur[2] ~= ARGV[2] then return false end
if cur[1] == ARGV[1] then return {cur[1]} end
return {cur[1], cur[3], cur[4], redis.call('LRANGE', KEYS[2], 0, -1), redis.call('LRANGE', KEYS[3], 0, -1)}
"""

# KEYS: owner index. ARGV: conversation key prefix. Newest first; expired ids are dropped.
LIST = """
local out = {}
for _, id in ipairs(redis.call('ZREVRANGE', KEYS[1], 0, -1)) do
  local s = redis.call('HGET', ARGV[1] .. id, 'summary')
  if s then out[#out + 1] = s else redis.call('ZREM', KEYS[1], id) end
end
return out
"""

# KEYS: conv hash, messages, archive, fence, lock, owner index, beat, changes. ARGV: owner, conv id.
DELETE = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return -2 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[7])
redis.call('ZREM', KEYS[6], ARGV[2])
redis.call('XADD', KEYS[8], 'MAXLEN', '~', CHANGES_KEPT, '*', 'o', ARGV[1], 'c', ARGV[2], 'd', '1')
return 1
"""

# KEYS: conv hash, lock, fence, beat. ARGV: owner, token, ttl ms, beat ttl ms. Answers the new fence.
# A lock whose heartbeat stopped is taken over: the new fence makes the silent turn's writes stale.
LOCK = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return -2 end
if redis.call('EXISTS', KEYS[2], KEYS[4]) == 2 then return -4 end
local fence = redis.call('INCR', KEYS[3])
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('PEXPIRE', KEYS[3], ttl) end
local value = fence .. ':' .. ARGV[2]
redis.call('SET', KEYS[2], value, 'PX', ARGV[3])
redis.call('SET', KEYS[4], value, 'PX', ARGV[4])
return fence
"""

# KEYS: running hash. ARGV: key prefix. Takes out the running turns whose lock or heartbeat is gone,
# answering them (value, conv id, ...) to this caller alone.
TAKE_DEAD = """
local out = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local conv = all[i]
  if redis.call('EXISTS', ARGV[1] .. 'lock:' .. conv, ARGV[1] .. 'beat:' .. conv) < 2 then
    redis.call('HDEL', KEYS[1], conv)
    table.insert(out, all[i + 1])
    table.insert(out, conv)
  end
end
return out
"""

# KEYS: running hash. ARGV: conv id, the value it was noted with. A later turn's entry stays.
FORGET_RUNNING = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""

# KEYS: lock, fence, beat. ARGV: the lock's value. Bumping the fence makes the released lock stale.
UNLOCK = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[3])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('INCR', KEYS[2]) end
return 1
"""

# KEYS: lock, beat. ARGV: the lock's value, ttl ms, beat ttl ms. A beat that lapsed while Redis was
# away comes back with the next renewal, unless another turn took the lock meanwhile.
RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""

# KEYS: events stream. ARGV: seq, turn id, frame, last ("1"/"0"), ttl ms. Seq 1 starts a new turn's
# stream; a seq already there (a retried append) is left as it is.
APPEND_EVENT = """
local seq = tonumber(ARGV[1])
if seq == 1 then
  redis.call('DEL', KEYS[1])
else
  local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
  if top and tonumber(string.match(top[1], '-(%d+)$')) >= seq then return 0 end
end
redis.call('XADD', KEYS[1], '0-' .. ARGV[1], 't', ARGV[2], 'f', ARGV[3], 'last', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""


def _score(iso: str) -> float:
    """An `updated_at` as milliseconds since the epoch (the list's order)."""
    try:
        return datetime.fromisoformat(iso).timestamp() * 1000
    except (TypeError, ValueError):
        return time.time() * 1000


def _json_list(raw: list[bytes]) -> list:
    return orjson.loads(b"[" + b",".join(raw) + b"]")


@dataclass(slots=True)
class _Stored:
    """One list field as last stored: its items' JSON and the very item objects it was made from."""

    raw: list[bytes]
    items: list


@dataclass(slots=True)
class _Cached:
    """One conversation as this process last read or wrote it."""

    version: int
    conv: dict
    lists: dict[str, _Stored | None]  # None: the field is not a list


def _plan(old: _Stored | None, items: object, known: bool) -> tuple[int, _Stored | None, list[bytes]]:
    """How to store one list field: (how many stored items to keep, what is then stored, the items
    to push after them). Keep -1: all of them; 0: none; -2: the field is no longer a list.
    `known`: `old` is what Redis holds (otherwise, as for a create, it may hold anything).

    Only the last RECHECK stored items are serialised again to find an edit in place (a reply
    being checkpointed); older ones are compared by identity, the rule the file store's sealed
    segments rely on too (an old message is replaced, never edited in place), so a long history
    costs nothing per write and an edit near the end rewrites only the end.
    """
    if not isinstance(items, list):
        return (-1 if known and old is None else -2), None, []
    if old is None:
        raw = [redact_json(orjson.dumps(item)) for item in items]
        return 0, _Stored(raw, list(items)), raw
    n = len(old.raw)
    cut = min(max(0, n - RECHECK), len(items))
    same = next((i for i in range(cut) if old.items[i] is not items[i]), cut)
    tail = [redact_json(orjson.dumps(item)) for item in items[same:]]
    if same == cut:
        k = 0
        while same + k < n and k < len(tail) and tail[k] == old.raw[same + k]:
            k += 1
        same, tail = same + k, tail[k:]
    return (-1 if same == n else same), _Stored(old.raw[:same] + tail, list(items)), tail


class RedisStore:
    """Everything in one Redis, shared by every process that points at it.

    `ttl_seconds` (CONVERSATION_TTL_DAYS × 86400): a conversation not written that long expires.
    `lock_ttl_ms`: a turn lock not renewed (`renew_turn`) that long is free again.
    `heartbeat_seconds`: how often a running turn beats; MISSED_BEATS beats missed and it no longer runs.
    """

    def __init__(self, url: str, *, prefix: str = "chat:", ttl_seconds: float | None = None,
                 lock_ttl_ms: int = 30_000, heartbeat_seconds: float = 1.0) -> None:
        self.url = url
        self.prefix = prefix
        self.ttl_ms = int(ttl_seconds * 1000) if ttl_seconds else 0
        self.lock_ttl_ms = lock_ttl_ms
        # A renewal is also the beat: as often as the heartbeat, and three times per lock expiry at least.
        self.renew_seconds = min(heartbeat_seconds, lock_ttl_ms / 3000)
        self.beat_ttl_ms = max(1, int(heartbeat_seconds * MISSED_BEATS * 1000))
        parts = urlsplit(url)
        # Never echo a password into an error message or a log.
        self.where = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        self.redis = aioredis.Redis.from_url(
            url, socket_connect_timeout=2, socket_timeout=5, health_check_interval=0,
            # A pooled connection Redis closed (a restart) fails once; a quick retry on a fresh one.
            # A timeout is not retried: a Redis that hangs should fail the request, not triple its wait.
            retry=Retry(ExponentialBackoff(cap=0.05, base=0.005), 2), retry_on_error=[RedisConnectionError])
        self._write = self.redis.register_script(WRITE.replace("CHANGES_KEPT", str(CHANGES_KEPT)))
        self._load = self.redis.register_script(LOAD)
        self._list = self.redis.register_script(LIST)
        self._delete = self.redis.register_script(DELETE.replace("CHANGES_KEPT", str(CHANGES_KEPT)))
        self._lock = self.redis.register_script(LOCK)
        self._unlock = self.redis.register_script(UNLOCK)
        self._renew = self.redis.register_script(RENEW)
        self._take_dead = self.redis.register_script(TAKE_DEAD)
        self._forget_running = self.redis.register_script(FORGET_RUNNING)
        self._append_event = self.redis.register_script(APPEND_EVENT)
        # The conversations this process read or wrote last, newest at the end (a bounded cache).
        self._cache: OrderedDict[str, _Cached] = OrderedDict()
        # One queue per conversation being written: its writes leave this process in call order.
        self._queues: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._stops: _StopListener | None = None

    # Keys.
    def conv_key(self, conv_id: str) -> str:
        return f"{self.prefix}conv:{conv_id}"

    def _conv_keys(self, conv_id: str) -> list[str]:
        key = self.conv_key(conv_id)
        return [key, f"{key}:messages", f"{key}:archive"]

    def index_key(self, owner: str) -> str:
        return f"{self.prefix}owner:{owner}:conversations"

    def fence_key(self, conv_id: str) -> str:
        return f"{self.prefix}fence:{conv_id}"

    def lock_key(self, conv_id: str) -> str:
        return f"{self.prefix}lock:{conv_id}"

    def beat_key(self, conv_id: str) -> str:
        return f"{self.prefix}beat:{conv_id}"

    def changes_key(self) -> str:
        return f"{self.prefix}changes"

    async def changes(self) -> AsyncGenerator[StoreChange, None]:
        """Followed from the stream's end as it is now: every process's writes, in order. While
        Redis is away the follower waits and goes on from where it was; a follower that falls more
        than CHANGES_KEPT changes behind misses the oldest (a restart's catch-up reads everything)."""
        with self.reachable():
            newest = await self.redis.xrevrange(self.changes_key(), count=1)
        after = newest[0][0] if newest else b"0-0"

        async def follow() -> AsyncGenerator[StoreChange, None]:
            nonlocal after
            while True:
                try:
                    answer = await self.redis.xread({self.changes_key(): after}, count=500, block=CHANGES_BLOCK_MS)
                except (RedisError, OSError) as exc:
                    log.warning("following the store's changes paused: %s", exc)
                    await asyncio.sleep(CHANGES_RETRY_SECONDS)
                    continue
                for _, entries in answer:
                    for entry_id, fields in entries:
                        after = entry_id
                        owner, conv_id = fields[b"o"].decode(), fields[b"c"].decode()
                        yield StoreChange(owner, conv_id, deleted=fields.get(b"d") == b"1",
                                          streaming=fields.get(b"s") == b"1")

        return follow()

    def running_key(self) -> str:
        return f"{self.prefix}running"

    async def note_running(self, conv_id: str, owner: str, turn_id: str) -> None:
        with self.reachable():
            await self.redis.hset(self.running_key(), conv_id, f"{owner}:{turn_id}")

    async def forget_running(self, conv_id: str, owner: str, turn_id: str) -> None:
        with self.reachable():
            await self._forget_running(keys=[self.running_key()], args=[conv_id, f"{owner}:{turn_id}"])

    async def take_dead_turns(self) -> list[tuple[str, str]]:
        """(owner, conv id) of each noted turn whose process stopped beating; each is answered once, to one caller."""
        with self.reachable():
            flat = await self._take_dead(keys=[self.running_key()], args=[self.prefix])
        return [(flat[i].decode().partition(":")[0], flat[i + 1].decode()) for i in range(0, len(flat), 2)]

    def _turn_keys(self, conv_id: str) -> tuple[str, str]:
        """The keys that both exist while a turn runs: its lock and its heartbeat."""
        return self.lock_key(conv_id), self.beat_key(conv_id)

    def memory_key(self, owner: str) -> str:
        return f"{self.prefix}memory:{owner}"

    def presets_key(self, owner: str) -> str:
        return self.document_key(owner, "presets")

    def document_key(self, owner: str, kind: str) -> str:
        return f"{self.prefix}{check_document(kind)}:{owner}"

    def share_key(self, share_id: str) -> str:
        return f"{self.prefix}share:{check_share_id(share_id)}"

    async def read_share(self, share_id: str) -> bytes | None:
        try:
            key = self.share_key(share_id)
        except NotFound:
            return None
        with self.reachable():
            return await self.redis.get(key)

    async def write_share(self, share_id: str, data: bytes) -> None:
        with self.reachable():
            await self.redis.set(self.share_key(share_id), data)

    async def delete_share(self, share_id: str) -> None:
        with self.reachable():
            await self.redis.delete(self.share_key(share_id))

    async def every_share(self) -> AsyncIterator[tuple[str, bytes]]:
        start = len(f"{self.prefix}share:")
        with self.reachable():
            async for key in self.redis.scan_iter(match=f"{self.prefix}share:*", count=500):
                share_id = key.decode()[start:]
                if SHARE_ID.fullmatch(share_id) and (data := await self.redis.get(key)) is not None:
                    yield share_id, data

    @contextmanager
    def reachable(self):
        """Turn the client's connection failures into the domain's StoreUnavailable."""
        try:
            yield
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise StoreUnavailable(f"Redis at {self.where} is unreachable ({exc})") from None

    def for_owner(self, owner: str) -> RedisOwnerStore:
        return RedisOwnerStore(self, _check_owner(owner))

    async def close(self) -> None:
        if self._stops is not None:
            await self._stops.close()
        await self.redis.aclose()

    async def ping(self) -> None:
        """Raise StoreUnavailable unless Redis answers (a readiness check at startup)."""
        with self.reachable():
            await self.redis.ping()

    async def flush(self) -> None:
        """Redis has every acknowledged write; wait for its fsync where it can say (Redis ≥ 7.2)."""
        with self.reachable():
            try:
                await self.redis.execute_command("WAITAOF", 1, 0, 1000)
            except ResponseError:
                pass  # older Redis or AOF off: `appendfsync everysec` bounds the loss to a second

    # Conversations, whoever owns them.
    async def load(self, conv_id: str, owner: str = "") -> dict:
        """The conversation (owner "": whoever owns it); NotFound for gone, foreign or invalid ids."""
        return (await self._fresh(conv_id, owner)).conv

    async def _fresh(self, conv_id: str, owner: str) -> _Cached:
        if not valid_id(conv_id):
            raise NotFound(conv_id)
        cached = self._cache.get(conv_id)
        index = self.index_key(owner) if owner else ""
        with self.reachable():
            found = await self._load(keys=[*self._conv_keys(conv_id), index],
                                     args=[cached.version if cached else "", owner, conv_id])
        if not found:
            # Gone, or another owner's: only a miss that could have read it says the copy is stale.
            entry = self._cache.get(conv_id)
            if entry is not None and owner in ("", entry.conv.get("owner")):
                del self._cache[conv_id]
            raise NotFound(conv_id)
        if len(found) == 1 and cached is not None:
            # Unchanged in Redis. While it answered, another request may have dropped the copy or
            # put a newer one in its place: keep whichever memory holds now.
            return self._remember(conv_id, self._cache.get(conv_id) or cached)
        version, head, lists, *items = found
        conv, lists = orjson.loads(head), orjson.loads(lists)
        stored: dict[str, _Stored | None] = dict.fromkeys(LISTS)
        for name, raw in zip(LISTS, items):
            if name in lists:
                conv[name] = _json_list(raw)
                stored[name] = _Stored(raw, list(conv[name]))
        return self._remember(conv_id, _Cached(int(version), conv, stored))

    def _remember(self, conv_id: str, entry: _Cached) -> _Cached:
        self._cache[conv_id] = entry
        self._cache.move_to_end(conv_id)
        while len(self._cache) > CACHED_CONVERSATIONS:
            self._cache.popitem(last=False)
        return entry

    async def conversation_ids(self) -> AsyncIterator[str]:
        """Every stored conversation's id (SCAN: for tools such as the migration, not for requests)."""
        with self.reachable():
            async for key in self.redis.scan_iter(match=f"{self.prefix}conv:*", count=500):
                conv_id = key.decode()[len(self.prefix) + len("conv:"):]
                if valid_id(conv_id):
                    yield conv_id

    async def every_conversation(self) -> AsyncIterator[dict]:
        async for conv_id in self.conversation_ids():
            try:
                yield await self.load(conv_id)
            except NotFound:
                continue  # deleted since the scan saw it

    async def owners(self) -> set[str]:
        """Every owner with a conversation index, a memory or a document (for the migration)."""
        found = set()
        documents = tuple((f"{self.prefix}{kind}:*", None) for kind in OWNER_DOCUMENTS)
        with self.reachable():
            for pattern, cut in ((f"{self.prefix}owner:*:conversations", -len(":conversations")),
                                 (f"{self.prefix}memory:*", None), *documents):
                start = len(pattern.split("*")[0])
                async for key in self.redis.scan_iter(match=pattern, count=500):
                    found.add(key.decode()[start:cut])
        return found

    async def put(self, conv: dict, *, expected: _Cached | None = None, fence: str = "",
                  nonce: str | None = None) -> _Cached:
        """Store a whole conversation (a new one, or the next version of `expected`)."""
        conv_id, owner = conv["id"], conv["owner"]
        head = {key: (None if key in LISTS and isinstance(value, list) else value) for key, value in conv.items()}
        lists = [name for name in LISTS if isinstance(conv.get(name), list)]
        args: list = [expected.version if expected else "", fence, nonce or new_id(), owner, redact_json(orjson.dumps(head)),
                      orjson.dumps(summary_of(conv)), _score(conv["updated_at"]), self.ttl_ms,
                      orjson.dumps(lists), conv_id, "1" if is_checkpoint(conv) else "0"]
        stored: dict[str, _Stored | None] = {}
        for name in LISTS:
            keep, stored[name], pushed = _plan(expected.lists[name] if expected else None, conv.get(name),
                                          expected is not None)
            args += [keep, len(pushed), *pushed]
        keys = [*self._conv_keys(conv_id), self.index_key(owner), self.fence_key(conv_id), self.changes_key()]
        with self.reachable():
            # Shielded: a caller cancelled meanwhile (Stop) must not leave the write half-sent.
            version = await asyncio.shield(self._write(keys=keys, args=args))
        if version == GONE:
            raise NotFound(conv_id)
        if version == STALE_LOCK:
            raise LockLost(conv_id)
        if version == CONFLICT:
            raise _Conflict
        return self._remember(conv_id, _Cached(int(version), conv, stored))

    def _queue(self, conv_id: str) -> asyncio.Lock:
        queue = self._queues.get(conv_id)
        if queue is None:
            queue = self._queues[conv_id] = asyncio.Lock()
        return queue

    async def update(self, conv_id: str, owner: str, change: Change, lock: TurnLock | None) -> dict:
        if lock is not None and (not isinstance(lock, FencedTurnLock) or lock.conv_id != conv_id
                                 or lock.owner != owner):
            raise LockLost(conv_id)
        fence = str(lock.fence) if lock is not None else ""
        nonce = new_id()  # the same for every attempt: a write that landed is recognised on retry
        async with self._queue(conv_id):
            entry = self._cache.get(conv_id)
            verified = False  # the cached copy may predate another process's write
            for _ in range(MAX_ATTEMPTS):
                if entry is None or entry.conv.get("owner") != owner:
                    entry, verified = await self._fresh(conv_id, owner), True
                conv = entry.conv
                try:
                    change(conv)
                    conv["updated_at"] = now_iso()
                except BaseException:
                    self._cache.pop(conv_id, None)  # memory may hold half the change: read it again
                    if verified:
                        raise
                    entry = None  # it may have failed only because this copy was stale
                    continue
                try:
                    return (await self.put(conv, expected=entry, fence=fence, nonce=nonce)).conv
                except _Conflict:
                    self._cache.pop(conv_id, None)
                    entry = None
                except BaseException:
                    self._cache.pop(conv_id, None)
                    raise
        raise StoreUnavailable(f"Redis at {self.where}: conversation {conv_id} changed {MAX_ATTEMPTS} times "
                               "under this write")

    async def _read_list(self, key: str, what: str) -> list[dict]:
        """The objects of a small JSON list under `key`; none when it is missing or damaged (logged)."""
        with self.reachable():
            raw = await self.redis.get(f"{self.prefix}{key}")
        try:
            data = orjson.loads(raw) if raw else []
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, list):
            log.warning("ignoring damaged %s in Redis", what)
            return []
        return [item for item in data if isinstance(item, dict)]

    async def read_custom_models(self) -> list[dict]:
        return [m for m in await self._read_list("models", "custom models") if isinstance(m.get("id"), str)
                and m.get("tier", "balanced") in ("fast", "balanced", "frontier")]

    async def write_custom_models(self, models: list[dict]) -> None:
        with self.reachable():
            await self.redis.set(f"{self.prefix}models", orjson.dumps(models))

    async def read_mcp_servers(self) -> list[dict]:
        return await self._read_list("mcp_servers", "MCP servers")

    async def write_mcp_servers(self, servers: list[dict]) -> None:
        with self.reachable():
            await self.redis.set(f"{self.prefix}mcp_servers", orjson.dumps(servers))

    # Small JSON values for other modules (accounts, sessions): the seam they build on.
    def _kv_key(self, key: str) -> str:
        if not isinstance(key, str) or not KV_KEY.fullmatch(key):
            raise ValueError(f"not a store key: {key!r}")
        return f"{self.prefix}kv:{key}"

    async def get_json(self, key: str) -> object | None:
        """The value stored under `key`, or None."""
        with self.reachable():
            raw = await self.redis.get(self._kv_key(key))
        return None if raw is None else orjson.loads(raw)

    async def set_json(self, key: str, value: object, *, ttl_seconds: float | None = None,
                       only_if_absent: bool = False) -> bool:
        """Store `value`; with `only_if_absent`, False (and nothing stored) when the key exists."""
        with self.reachable():
            done = await self.redis.set(self._kv_key(key), orjson.dumps(value),
                                        px=int(ttl_seconds * 1000) if ttl_seconds else None, nx=only_if_absent)
        return bool(done)

    async def delete_json(self, key: str) -> bool:
        with self.reachable():
            return bool(await self.redis.delete(self._kv_key(key)))

    async def json_keys(self, prefix: str = "") -> list[str]:
        """Every key starting with `prefix` (SCAN: for listing accounts, not per request)."""
        if prefix:
            self._kv_key(prefix)
        start = len(f"{self.prefix}kv:")
        with self.reachable():
            return sorted([key.decode()[start:] async for key in
                           self.redis.scan_iter(match=f"{self.prefix}kv:{prefix}*", count=500)])


    # Stop from any process: one pattern subscription per process, dispatched to the turns it runs.
    async def publish_stop(self, conv_id: str, assistant_id: str | None = None) -> int:
        """Ask whichever process runs `conv_id`'s turn to stop it (only its reply `assistant_id`, given
        one); how many processes heard the request.

        0 means no process is listening just now (none started a turn yet, or one is re-subscribing
        after Redis came back): a caller that still sees the turn locked may ask again.
        """
        with self.reachable():
            return await self.redis.publish(f"{self.prefix}stop:{_stop_key(conv_id, assistant_id)}", b"stop")

    @asynccontextmanager
    async def subscribe_stop(self, conv_id: str, assistant_id: str | None = None) -> AsyncIterator[asyncio.Event]:
        """Within the block, the event is set once a stop for `conv_id` (for its reply `assistant_id`,
        given one) is published by any process.

        Entering waits until this process's subscription is live (StoreUnavailable if Redis does
        not answer), so a stop published after entering is never missed while Redis stays up.
        """
        if self._stops is None:
            self._stops = _StopListener(self)
        event = asyncio.Event()
        key = _stop_key(conv_id, assistant_id)
        await self._stops.add(key, event)
        try:
            yield event
        finally:
            self._stops.remove(key, event)

    # A running turn's events, so that any process can replay and follow them (re-attach).
    def events_key(self, conv_id: str) -> str:
        return f"{self.prefix}events:{conv_id}"

    async def append_turn_event(self, conv_id: str, turn_id: str, seq: int, frame: bytes, *,
                                last: bool = False, keep_seconds: float = 60) -> None:
        """Record event `seq` (1, 2, …) of turn `turn_id`; seq 1 replaces the previous turn's events.

        `last`: the turn is over; its events stay readable `keep_seconds` longer, then go. A stream
        whose process died before its last event goes EVENTS_TTL after its latest one. Appending a
        seq already recorded (a retry after a lost reply) changes nothing.
        """
        ttl = int(keep_seconds * 1000) if last else EVENTS_TTL_MS
        with self.reachable():
            await self._append_event(keys=[self.events_key(conv_id)],
                                     args=[seq, turn_id, frame, b"1" if last else b"0", ttl])

    async def read_turn_events(self, conv_id: str, after: int = 0, *, turn_id: str | None = None,
                               block_ms: int = 1000, still_running: Callable[[], Awaitable[bool]] | None = None,
                               ) -> AsyncIterator[tuple[int, bytes]]:
        """Every event after seq `after`, in order and once each, then the ones still to come, until
        the turn's last event; ends at once if no turn's events are kept. `turn_id`: only that turn's
        (default: the turn of the first event read); it ends where another turn's events begin.
        `still_running`: asked whenever a wait brings nothing; False ends the read (the process
        running the turn died, so its last event will never come).
        """
        key, last_id = self.events_key(conv_id), f"0-{after}"
        while True:
            with self.reachable():
                found = await self.redis.xread({key: last_id}, count=500, block=block_ms)
                if not found and not await self.redis.exists(key):
                    return
            if not found and still_running is not None and not await still_running():
                return
            for entry_id, fields in (found[0][1] if found else []):
                if turn_id is None:
                    turn_id = fields[b"t"].decode()
                elif fields[b"t"].decode() != turn_id:
                    return
                last_id = entry_id
                yield int(entry_id.split(b"-")[1]), fields[b"f"]
                if fields[b"last"] == b"1":
                    return


    async def wait_turn_event(self, conv_id: str, after: int, *, block_ms: int) -> bool:
        """Wait (at most `block_ms`) for an event after seq `after`; whether one is there."""
        with self.reachable():
            return bool(await self.redis.xread({self.events_key(conv_id): f"0-{after}"}, count=1, block=block_ms))

    async def turn_state(self, conv_id: str) -> tuple[bool, TurnTail | None]:
        """Whether a live turn holds `conv_id`'s lock, and the latest event kept of its turns (one round trip)."""
        with self.reachable():
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.exists(*self._turn_keys(conv_id))
                pipe.xrevrange(self.events_key(conv_id), count=1)
                held, top = await pipe.execute()
        locked = held == 2
        if not top:
            return locked, None
        entry_id, fields = top[0]
        return locked, TurnTail(int(entry_id.split(b"-")[1]), fields[b"t"].decode(), fields[b"last"] == b"1")

    async def turn_locked(self, conv_id: str) -> bool:
        """Whether a turn (of any owner, in any process) holds `conv_id` now and its process still beats."""
        with self.reachable():
            return await self.redis.exists(*self._turn_keys(conv_id)) == 2

    async def stored_reply(self, conv_id: str, message_id: str) -> dict | None:
        """Message `message_id` as its owner reads it (a dead turn's checkpoint reads interrupted), or None."""
        with self.reachable():
            owner = await self.redis.hget(self.conv_key(conv_id), "owner")
        if owner is None:
            return None
        with suppress(NotFound):
            conv = await self.for_owner(owner.decode()).get(conv_id)
            # A compared reply other than the first is off the path.
            return next((m for m in [*reversed(conv["messages"]), *(conv.get("off_path") or [])]
                         if m["id"] == message_id), None)
        return None


@dataclass(frozen=True, slots=True)
class TurnTail:
    """The latest event kept of a conversation's turns: its seq, its turn, whether the turn ended there."""

    seq: int
    turn_id: str
    last: bool


def _stop_key(conv_id: str, assistant_id: str | None) -> str:
    """The stop channel's suffix: a conversation id has no ':', so a reply's channel never names another's."""
    return conv_id if assistant_id is None else f"{conv_id}:{assistant_id}"


class _StopListener:
    """One PSUBSCRIBE per process to every conversation's stop channel; sets the waiting turns' events."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self.channel_prefix = f"{store.prefix}stop:".encode()
        self.waiting: dict[str, set[asyncio.Event]] = {}
        self.live = asyncio.Event()
        self.failure: str = ""
        self.task: asyncio.Task | None = None

    async def add(self, key: str, event: asyncio.Event) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run(), name="redis stop listener")
        self.waiting.setdefault(key, set()).add(event)
        try:
            await asyncio.wait_for(self.live.wait(), SUBSCRIBE_TIMEOUT)
        except asyncio.TimeoutError:
            self.remove(key, event)
            raise StoreUnavailable(f"Redis at {self.store.where} is unreachable ({self.failure or 'no answer'})") \
                from None

    def remove(self, key: str, event: asyncio.Event) -> None:
        events = self.waiting.get(key)
        if events is not None:
            events.discard(event)
            if not events:
                del self.waiting[key]

    async def _run(self) -> None:
        while True:
            pubsub = self.store.redis.pubsub()
            try:
                await pubsub.psubscribe(self.channel_prefix + b"*")
                while True:
                    # A bounded wait, not a blocking read: an idle subscription must not trip the
                    # client's socket timeout, and a dead connection must surface.
                    message = await pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    if message["type"] == "psubscribe":
                        self.live.set()
                    elif message["type"] == "pmessage":
                        key = message["channel"][len(self.channel_prefix):].decode()
                        for event in self.waiting.get(key, ()):
                            event.set()
            except Exception as exc:
                self.live.clear()
                self.failure = str(exc)
                if not isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
                    log.exception("the stop subscription failed; subscribing again")
                await asyncio.sleep(RESUBSCRIBE_DELAY)  # Redis is away: try again shortly, not in a hot loop
            finally:
                with suppress(Exception):
                    await pubsub.aclose()

    async def close(self) -> None:
        await tasks.stop(self.task)


class _Conflict(Exception):
    """Another process wrote the conversation since this write's version was read."""


class RedisOwnerStore:
    """One owner's view of a RedisStore: the owner is checked inside every script."""

    def __init__(self, store: RedisStore, owner: str) -> None:
        self.store = store
        self.owner = owner
        self.lock_renew_seconds = store.renew_seconds

    async def create(self, conv: dict) -> dict:
        conv = upgrade({**conv, "owner": self.owner})
        if not valid_id(conv.get("id", "")):
            raise ValueError(f"not a conversation id: {conv.get('id')!r}")
        return (await self.store.put(conv)).conv

    async def get(self, conv_id: str) -> dict:
        """The conversation; a reply left `streaming` while no turn holds the lock reads `interrupted`.

        Such a reply is the last checkpoint of a process that died mid-turn (its heartbeat stopped). It
        is recovered in the copy answered, not in Redis: the next turn's opening write stores it so.
        """
        conv = await self.store.load(conv_id, self.owner)
        if not streaming_replies(conv) or await self.store.turn_locked(conv_id):
            return conv
        # The turn may have saved and let go between the read and the lock check: read once more
        # (one short round trip when nothing changed).
        conv = await self.store.load(conv_id, self.owner)
        if not streaming_replies(conv):
            return conv
        # A copy: the cached conversation must stay what Redis holds.
        recovered = {**conv, "totals": dict(conv["totals"])}
        for name in ("messages", "off_path"):
            if name in conv:
                recovered[name] = [dict(m) for m in conv[name]]
                for message in recovered[name]:
                    if isinstance(message.get("usage"), dict):
                        message["usage"] = dict(message["usage"])
        if recover_interrupted(recovered):
            log.warning("conversation %s: a reply left streaming by a process that died reads as interrupted", conv_id)
        return recovered

    async def update(self, conv_id: str, change: Change, *, lock: TurnLock | None = None) -> dict:
        return await self.store.update(conv_id, self.owner, change, lock)

    async def checkpoint(self, conv_id: str, message: dict | None, *, lock: TurnLock,
                         off_path: Sequence[dict] = ()) -> None:
        """An update: the reply's item near the end of the list is trimmed and pushed again."""
        await self.update(conv_id, lambda conv: place_replies(conv, message, off_path), lock=lock)

    async def update_soon(self, conv_id: str, change: Change, *,
                          lock: TurnLock | None = None) -> tuple[dict, Awaitable[None]]:
        """Once Redis has the write every process reads it, and it is as durable as Redis makes it."""
        conv = await self.update(conv_id, change, lock=lock)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return conv, done

    async def list(self) -> list[dict]:
        """Newest first."""
        with self.store.reachable():
            found = await self.store._list(keys=[self.store.index_key(self.owner)],
                                           args=[self.store.conv_key("")])
        return [orjson.loads(s) for s in found]

    async def delete(self, conv_id: str) -> None:
        if not valid_id(conv_id):
            raise NotFound(conv_id)
        s = self.store
        keys = [*s._conv_keys(conv_id), s.fence_key(conv_id), s.lock_key(conv_id), s.index_key(self.owner),
                s.beat_key(conv_id), s.changes_key()]
        with s.reachable():
            done = await s._delete(keys=keys, args=[self.owner, conv_id])
        s._cache.pop(conv_id, None)
        if done == GONE:
            raise NotFound(conv_id)

    async def read_memory(self) -> str:
        with self.store.reachable():
            raw = await self.store.redis.get(self.store.memory_key(self.owner))
        return "" if raw is None else raw.decode("utf-8", "replace")

    async def write_memory(self, text: str) -> None:
        with self.store.reachable():
            await self.store.redis.set(self.store.memory_key(self.owner), text.encode("utf-8"))

    async def forget_memory(self) -> None:
        with self.store.reachable():
            await self.store.redis.delete(self.store.memory_key(self.owner))

    async def read_presets(self) -> bytes | None:
        return await self.read_document("presets")

    async def update_presets(self, change: Callable[[bytes | None], bytes]) -> None:
        await self.update_document("presets", change)

    async def forget_presets(self) -> None:
        await self.forget_document("presets")

    async def read_document(self, kind: str) -> bytes | None:
        with self.store.reachable():
            return await self.store.redis.get(self.store.document_key(self.owner, kind))

    async def update_document(self, kind: str, change: Callable[[bytes | None], bytes]) -> None:
        """Optimistic: WATCH the key, compute, write in MULTI; recomputed when another process wrote between."""
        key = self.store.document_key(self.owner, kind)
        with self.store.reachable():
            for _ in range(MAX_ATTEMPTS):
                async with self.store.redis.pipeline(transaction=True) as pipe:
                    await pipe.watch(key)
                    new = change(await pipe.get(key))
                    pipe.multi()
                    pipe.set(key, new)
                    try:
                        await pipe.execute()
                        return
                    except WatchError:
                        continue
        raise StoreUnavailable(f"Redis at {self.store.where}: {kind} changed {MAX_ATTEMPTS} times under this write")

    async def forget_document(self, kind: str) -> None:
        with self.store.reachable():
            await self.store.redis.delete(self.store.document_key(self.owner, kind))

    async def lock_turn(self, conv_id: str) -> FencedTurnLock:
        if not valid_id(conv_id):
            raise NotFound(conv_id)
        s = self.store
        token = new_id()
        with s.reachable():
            fence = await s._lock(keys=[s.conv_key(conv_id), s.lock_key(conv_id), s.fence_key(conv_id),
                                        s.beat_key(conv_id)],
                                  args=[self.owner, token, s.lock_ttl_ms, s.beat_ttl_ms])
        if fence == GONE:
            raise NotFound(conv_id)
        if fence == BUSY:
            raise TurnBusy(conv_id)
        return FencedTurnLock(self.owner, conv_id, token, int(fence))

    async def renew_turn(self, lock: TurnLock) -> bool:
        """Extend a held lock by the lock expiry; False when it is no longer this turn's."""
        if not isinstance(lock, FencedTurnLock):
            return False
        s = self.store
        with s.reachable():
            return bool(await s._renew(keys=list(s._turn_keys(lock.conv_id)),
                                       args=[lock.value, s.lock_ttl_ms, s.beat_ttl_ms]))

    async def unlock_turn(self, lock: TurnLock) -> None:
        if not isinstance(lock, FencedTurnLock):
            return
        s = self.store
        with s.reachable():
            await s._unlock(keys=[s.lock_key(lock.conv_id), s.fence_key(lock.conv_id), s.beat_key(lock.conv_id)],
                            args=[lock.value])

    async def turn_locked(self, conv_id: str) -> bool:
        """Whether a turn holds this owner's conversation; another owner's id is NotFound, like an unknown one."""
        if not valid_id(conv_id):
            raise NotFound(conv_id)
        with self.store.reachable():
            async with self.store.redis.pipeline(transaction=False) as pipe:
                pipe.hget(self.store.conv_key(conv_id), "owner")
                pipe.exists(*self.store._turn_keys(conv_id))
                owner, held = await pipe.execute()
        if owner is None or (owner.decode() if isinstance(owner, bytes) else owner) != self.owner:
            raise NotFound(conv_id)
        return held == 2
