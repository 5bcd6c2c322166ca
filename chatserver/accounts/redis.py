"""Accounts for STORE=redis: users, sessions and the login throttle in the Redis every server shares,
on the conversation store's connection and under its key prefix (`chat:` by default).

Keys:
- `users` a hash: lower-cased name -> the user's record (JSON); `users:order` their names in the
  order they were added (a sorted set numbered by `users:order:next`); `users:local_owner_taken`
  is set once an admin has inherited the single-person data (owner "local").
- `session:<sha256 of the id>` the session's record (JSON), expiring SESSION_HOURS after its last
  recorded use (PX, pushed back by each touch, at most once per TOUCH_SECONDS);
  `user_sessions:<lower-cased name>` a set of the digests of a user's sessions, so removing the user
  or changing the password deletes them (pruned of expired ones whenever a session is added).
- `throttle:<key>` a sorted set per throttled key (`user:<name> address:<ip>`, `address:<ip>`,
  `user:<name>`) of the attempts in the window, scored by time (ms): `a:<token>` for a guess being
  checked, `g:<tag>` for a wrong one; `throttle_salt` keys the tags; `pace:<key>` the next paced
  login's time for a name past its ceiling. Every count and check is one Lua step, so two servers
  cannot both pass the check on the same last slot.

A wrong guess is kept as a 32-bit tag (HMAC-SHA256 under the shared salt, truncated) for the window:
enough to count a repeated guess once, too short to tell what was typed.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from collections.abc import Callable
from contextlib import AbstractContextManager

import orjson
import redis.asyncio as aioredis

from chatserver.accounts.store import (
    WINDOW_SECONDS,
    AccountsDump,
    Attempt,
    BadAccount,
    LastAdmin,
    Throttled,
    check_new_name,
    new_user_record,
)

# The conversation store's `reachable()`: Redis connection failures as StoreUnavailable (a 503).
Reachable = Callable[[], AbstractContextManager[None]]

# KEYS: users hash, the taken flag, the order. ARGV: lower name, the record inheriting "local", the
# record with an owner of its own, "1" for an admin. Answers the record stored, or false for a taken name.
ADD_USER = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return false end
redis.call('ZADD', KEYS[3], redis.call('HINCRBY', KEYS[3] .. ':next', 'n', 1), ARGV[1])
if ARGV[4] == '1' and redis.call('SETNX', KEYS[2], '1') == 1 then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  return ARGV[2]
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return ARGV[3]
"""

# Deleting every session of a user (its set, KEYS[2]; session keys are ARGV[2] .. digest).
_END_SESSIONS = """
for _, d in ipairs(redis.call('SMEMBERS', KEYS[2])) do redis.call('DEL', ARGV[2] .. d) end
redis.call('DEL', KEYS[2])
"""

# KEYS: users hash, the user's session set. ARGV: lower name, session key prefix, the record as read,
# the new record, "1" to end the user's sessions. 1 done, -1 changed since read, -2 no such user.
SET_USER = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return -2 end
if cur ~= ARGV[3] then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[4])
if ARGV[5] == '1' then
""" + _END_SESSIONS + """
end
return 1
"""

# KEYS: users hash, the user's session set, the order. ARGV: lower name, session key prefix, "1" to
# refuse removing the last admin. The removed record, false, or 'last admin' (nothing removed).
_LAST_ADMIN = """
local admins = 0
for _, v in ipairs(redis.call('HVALS', KEYS[1])) do
  if cjson.decode(v)['admin'] == true then admins = admins + 1 end
end
"""

REMOVE_USER = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return false end
if ARGV[3] == '1' and cjson.decode(cur)['admin'] == true then
""" + _LAST_ADMIN + """
  if admins <= 1 then return 'last admin' end
end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
""" + _END_SESSIONS + """
return cur
"""

# KEYS: users hash. ARGV: lower name, "1" admin or "0" not. The record as now stored, false for no
# such user, or 'last admin' (nothing changed): counted and changed in one step, so two admins
# demoting each other at once cannot leave none.
SET_ADMIN = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return false end
local record = cjson.decode(cur)
if ARGV[2] == '0' and record['admin'] == true then
""" + _LAST_ADMIN + """
  if admins <= 1 then return 'last admin' end
end
record['admin'] = ARGV[2] == '1'
local out = cjson.encode(record)
redis.call('HSET', KEYS[1], ARGV[1], out)
return out
"""

# KEYS: users hash, the order. ARGV: lower name, record. Adds or replaces (a replaced user keeps its place).
PUT_USER = """
if redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('ZADD', KEYS[2], redis.call('HINCRBY', KEYS[2] .. ':next', 'n', 1), ARGV[1])
end
return 1
"""

# KEYS: session key, users hash. Answers false, or {session, the user it names (nil if none)}.
READ_SESSION = """
local s = redis.call('GET', KEYS[1])
if not s then return false end
local name = cjson.decode(s)['username']
local u = false
if type(name) == 'string' then u = redis.call('HGET', KEYS[2], string.lower(name)) end
return {s, u}
"""

# KEYS: session key, the user's session set. ARGV: record, ttl ms, digest, session key prefix.
SAVE_SESSION = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
for _, d in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if redis.call('EXISTS', ARGV[4] .. d) == 0 then redis.call('SREM', KEYS[2], d) end
end
redis.call('SADD', KEYS[2], ARGV[3])
return 1
"""

# KEYS: one sorted set per key. ARGV: now ms, window ms, the attempt's member, then each key's limit
# ("" for none). Answers 0 (counted against every key) or the ms until the fullest key has room.
RESERVE = """
local now, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local wait = 0
for i, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
  local limit = tonumber(ARGV[3 + i])
  if limit and redis.call('ZCARD', key) >= limit then
    local oldest = tonumber(redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')[2])
    wait = math.max(wait, oldest + window - now, 1)
  end
end
if wait > 0 then return wait end
for _, key in ipairs(KEYS) do
  redis.call('ZADD', key, now, ARGV[3])
  redis.call('PEXPIRE', key, window)
end
return 0
"""

# KEYS: the attempt's sorted sets. ARGV: now ms, window ms, the attempt's member, the guess's member.
# Answers 1 when some key had not counted this guess yet.
FAIL = """
local new = 0
for _, key in ipairs(KEYS) do
  redis.call('ZREM', key, ARGV[3])
  if not redis.call('ZSCORE', key, ARGV[4]) then new = 1 end
  redis.call('ZADD', key, ARGV[1], ARGV[4])
  redis.call('PEXPIRE', key, ARGV[2])
end
return new
"""

# KEYS: the name's sorted set, its pace key. ARGV: now ms, window ms, ceiling, spacing ms.
# Answers the ms this attempt waits: 0 up to the ceiling, then one slot `spacing` after the last,
# in Redis's own time, whichever server asks.
TURN = """
local now = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
if redis.call('ZCARD', KEYS[1]) <= tonumber(ARGV[3]) then return 0 end
local t = redis.call('TIME')
local real = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local start = math.max(real, tonumber(redis.call('GET', KEYS[2]) or '0'))
local spacing = tonumber(ARGV[4])
redis.call('SET', KEYS[2], start + spacing, 'PX', start + spacing - real + 1000)
return start - real
"""

TAG_BYTES = 4


class RedisThrottle:
    """The login throttle in Redis: one count of guesses for every server."""

    def __init__(self, redis: aioredis.Redis, prefix: str, reachable: Reachable) -> None:
        self.redis = redis
        self.prefix = prefix
        self.reachable = reachable
        self._reserve = redis.register_script(RESERVE)
        self._fail = redis.register_script(FAIL)
        self._turn = redis.register_script(TURN)
        self._salt: bytes | None = None

    def _key(self, key: str) -> str:
        return f"{self.prefix}throttle:{key}"

    async def reserve(self, limits: list[tuple[str, int | None]], now: float) -> Attempt:
        attempt = Attempt([key for key, _ in limits])
        with self.reachable():
            wait = await self._reserve(keys=[self._key(k) for k in attempt.keys],
                                       args=[_ms(now), WINDOW_SECONDS * 1000, f"a:{attempt.token}",
                                             *["" if limit is None else limit for _, limit in limits]])
        if wait:
            raise Throttled(max(1, math.ceil(int(wait) / 1000)))
        return attempt

    async def fail(self, attempt: Attempt, guess: str, now: float) -> bool:
        tag = hmac.new(await self._shared_salt(), guess.encode("utf-8", "surrogatepass"), hashlib.sha256)
        with self.reachable():
            new = await self._fail(keys=[self._key(k) for k in attempt.keys],
                                   args=[_ms(now), WINDOW_SECONDS * 1000, f"a:{attempt.token}",
                                         f"g:{tag.hexdigest()[:TAG_BYTES * 2]}"])
        return bool(new)

    async def refund(self, attempt: Attempt) -> None:
        with self.reachable():
            async with self.redis.pipeline(transaction=False) as pipe:
                for key in attempt.keys:
                    pipe.zrem(self._key(key), f"a:{attempt.token}")
                await pipe.execute()

    async def clear(self, key: str) -> None:
        with self.reachable():
            await self.redis.delete(self._key(key))

    async def turn(self, key: str, ceiling: int, spacing: float, now: float) -> float:
        with self.reachable():
            wait = await self._turn(keys=[self._key(key), f"{self.prefix}pace:{key}"],
                                    args=[_ms(now), WINDOW_SECONDS * 1000, ceiling, int(spacing * 1000)])
        return int(wait) / 1000

    async def _shared_salt(self) -> bytes:
        """The key of the guesses' tags, the same on every server (made by the first that needs it)."""
        if self._salt is None:
            key = f"{self.prefix}throttle_salt"
            with self.reachable():
                await self.redis.set(key, secrets.token_hex(16), nx=True)
                self._salt = await self.redis.get(key)
        assert self._salt is not None
        return self._salt


class RedisAccountStore:
    """Users, sessions and the throttle in Redis (see the module's docstring for the keys)."""

    def __init__(self, redis: aioredis.Redis, prefix: str, idle_seconds: float, reachable: Reachable) -> None:
        self.redis = redis
        self.prefix = prefix
        self.idle_seconds = idle_seconds
        self.reachable = reachable
        self.throttle = RedisThrottle(redis, prefix, self.reachable)
        self._add_user = redis.register_script(ADD_USER)
        self._set_user = redis.register_script(SET_USER)
        self._remove_user = redis.register_script(REMOVE_USER)
        self._set_admin = redis.register_script(SET_ADMIN)
        self._put_user = redis.register_script(PUT_USER)
        self._read_session = redis.register_script(READ_SESSION)
        self._save_session = redis.register_script(SAVE_SESSION)

    # Keys.
    @property
    def users_key(self) -> str:
        return f"{self.prefix}users"

    @property
    def _order_key(self) -> str:
        return f"{self.prefix}users:order"

    def _user_sessions_key(self, name: str) -> str:
        return f"{self.prefix}user_sessions:{name.lower()}"

    @property
    def _session_prefix(self) -> str:
        return f"{self.prefix}session:"

    def _ttl_ms(self, record: dict, now: float) -> int:
        return int((record["last_seen"] + self.idle_seconds - now) * 1000)

    async def _hget(self, key: str, name: str) -> bytes | None:
        return await self.redis.hget(key, name)  # type: ignore[misc]  # redis-py types it for both clients

    # Users.
    async def find_user(self, name: str) -> dict | None:
        with self.reachable():
            raw = await self._hget(self.users_key, name.lower())
        return None if raw is None else orjson.loads(raw)

    async def users(self) -> list[dict]:
        with self.reachable():
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(self.users_key)
                pipe.zrange(self._order_key, 0, -1)
                found, order = await pipe.execute()
        place = {name: i for i, name in enumerate(order)}
        return [orjson.loads(found[name]) for name in sorted(found, key=lambda n: place.get(n, len(place)))]

    async def add_user(self, name: str, password_hash: str | None, admin: bool, now: float) -> dict:
        check_new_name(name)
        inheriting = new_user_record(name, password_hash, admin, now, inherits=True)
        own = {**inheriting, "owner": new_user_record(name, None, admin, now, inherits=False)["owner"]}
        with self.reachable():
            stored = await self._add_user(keys=[self.users_key, f"{self.users_key}:local_owner_taken", self._order_key],
                                          args=[name.lower(), orjson.dumps(inheriting), orjson.dumps(own),
                                                "1" if admin else "0"])
        if stored is None:
            raise BadAccount(f"there is already a user named {name!r}")
        return orjson.loads(stored)

    async def set_password(self, name: str, password_hash: str, *, end_sessions: bool = True) -> None:
        while True:
            with self.reachable():
                raw = await self._hget(self.users_key, name.lower())
            if raw is None:
                raise BadAccount(f"there is no user named {name!r}")
            record = {**orjson.loads(raw), "password_hash": password_hash}
            if end_sessions:
                record["epoch"] = secrets.token_hex(8)
            with self.reachable():
                done = await self._set_user(keys=[self.users_key, self._user_sessions_key(name)],
                                            args=[name.lower(), self._session_prefix, raw, orjson.dumps(record),
                                                  "1" if end_sessions else "0"])
            if done == -2:
                raise BadAccount(f"there is no user named {name!r}")
            if done == 1:
                return
            # -1: another process changed the record between the read and the write; read it again.

    async def remove_user(self, name: str, *, keep_an_admin: bool = False) -> dict:
        with self.reachable():
            removed = await self._remove_user(keys=[self.users_key, self._user_sessions_key(name), self._order_key],
                                              args=[name.lower(), self._session_prefix, "1" if keep_an_admin else "0"])
        if removed is None:
            raise BadAccount(f"there is no user named {name!r}")
        if removed == b"last admin":
            raise LastAdmin(name)
        return orjson.loads(removed)

    async def set_admin(self, name: str, admin: bool) -> dict:
        with self.reachable():
            stored = await self._set_admin(keys=[self.users_key], args=[name.lower(), "1" if admin else "0"])
        if stored is None:
            raise BadAccount(f"there is no user named {name!r}")
        if stored == b"last admin":
            raise LastAdmin(name)
        return orjson.loads(stored)

    # Sessions.
    async def session(self, digest: str) -> tuple[dict, dict | None] | None:
        with self.reachable():
            found = await self._read_session(keys=[self._session_prefix + digest, self.users_key])
        if not found:
            return None
        session, user = found[0], found[1] if len(found) > 1 else None
        return orjson.loads(session), (orjson.loads(user) if user else None)

    async def save_session(self, digest: str, record: dict, now: float) -> None:
        ttl = self._ttl_ms(record, now)
        if ttl <= 0:
            return
        with self.reachable():
            await self._save_session(keys=[self._session_prefix + digest, self._user_sessions_key(record["username"])],
                                     args=[orjson.dumps(record), ttl, digest, self._session_prefix])

    async def touch_session(self, digest: str, record: dict, now: float) -> None:
        with self.reachable():
            # XX: a session another server ended meanwhile is not brought back.
            await self.redis.set(self._session_prefix + digest, orjson.dumps(record),
                                 px=max(1, self._ttl_ms(record, now)), xx=True)

    async def end_session(self, digest: str) -> None:
        with self.reachable():
            await self.redis.delete(self._session_prefix + digest)

    # Migration.
    async def export_accounts(self) -> AccountsDump:
        users = await self.users()
        with self.reachable():
            taken = bool(await self.redis.exists(f"{self.users_key}:local_owner_taken"))
            sessions = []
            async for key in self.redis.scan_iter(match=f"{self._session_prefix}*", count=500):
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.get(key)
                    pipe.pttl(key)
                    raw, ttl = await pipe.execute()
                if raw is not None and ttl > 0:
                    sessions.append((key.decode()[len(self._session_prefix):], orjson.loads(raw), ttl / 1000))
        return AccountsDump(users=users, local_owner_taken=taken, sessions=sessions)

    async def import_accounts(self, dump: AccountsDump) -> None:
        with self.reachable():
            for user in dump.users:
                await self._put_user(keys=[self.users_key, self._order_key],
                                     args=[user["name"].lower(), orjson.dumps(user)])
            if dump.local_owner_taken:
                await self.redis.set(f"{self.users_key}:local_owner_taken", "1")
        for digest, record, left in dump.sessions:
            if left > 0:
                with self.reachable():
                    await self._save_session(
                        keys=[self._session_prefix + digest, self._user_sessions_key(record["username"])],
                        args=[orjson.dumps(record), max(1, int(left * 1000)), digest, self._session_prefix])

    async def close(self) -> None:
        pass  # the connection is the conversation store's, which closes it


def _ms(seconds: float) -> int:
    return int(seconds * 1000)

