"""Accounts for STORE=files (one process): users in DATA_DIR/users.json, sessions in
DATA_DIR/sessions.json (only digests of their ids), and the login throttle in this process's memory.

`python server.py user ...` edits users.json under the same file lock a running server uses, which
picks the change up without a restart.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import hmac
import logging
import math
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson

from chatserver.accounts.store import (
    SCHEMA_VERSION,
    WINDOW_SECONDS,
    AccountsDump,
    Attempt,
    BadAccount,
    LastAdmin,
    Throttled,
    check_new_name,
    new_user_record,
)
from chatserver.store.files import atomic_write

log = logging.getLogger("chat.auth")


class UserFile:
    """The accounts in DATA_DIR/users.json; read-modify-write happens under a file lock."""

    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / "users.json"
        self._cache: dict = {"users": []}
        self._stamp: tuple[int, int] | None = None

    def load(self) -> dict:
        """The file's content, re-read only when it changed (the CLI edits it under a running server)."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._cache, self._stamp = {"users": []}, None
            return self._cache
        if (stat.st_mtime_ns, stat.st_size) != self._stamp:
            self._cache = orjson.loads(self.path.read_bytes())
            self._stamp = (stat.st_mtime_ns, stat.st_size)
        return self._cache

    def find(self, name: str) -> dict | None:
        wanted = name.lower()
        return next((u for u in self.load()["users"] if u["name"].lower() == wanted), None)

    @contextmanager
    def edit(self) -> Iterator[dict]:
        """Yield the content to change in place; it is written atomically when the block ends."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name("users.json.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._stamp = None
            content = self.load()
            yield content
            content["schema_version"] = SCHEMA_VERSION
            atomic_write(self.path, orjson.dumps(content, option=orjson.OPT_INDENT_2))
            self._stamp = None

    def add(self, name: str, password_hash: str | None, admin: bool, now: float) -> dict:
        """A new account; the first admin ever made inherits the single-person data (owner "local")."""
        check_new_name(name)
        with self.edit() as content:
            if any(u["name"].lower() == name.lower() for u in content["users"]):
                raise BadAccount(f"there is already a user named {name!r}")
            inherits = admin and not content.get("local_owner_taken")
            record = new_user_record(name, password_hash, admin, now, inherits=inherits)
            content["users"].append(record)
            content["local_owner_taken"] = content.get("local_owner_taken", False) or inherits
        return record

    def set_password(self, name: str, password_hash: str, end_sessions: bool = True) -> None:
        """Change a password; a new epoch ends every session the user had."""
        with self.edit() as content:
            record = _named(content, name)
            record["password_hash"] = password_hash
            if end_sessions:
                record["epoch"] = secrets.token_hex(8)

    def remove(self, name: str, keep_an_admin: bool = False) -> dict:
        with self.edit() as content:
            record = _named(content, name)
            if keep_an_admin and record.get("admin"):
                _not_the_last_admin(content, name)
            content["users"].remove(record)
        return record

    def set_admin(self, name: str, admin: bool) -> dict:
        with self.edit() as content:
            record = _named(content, name)
            if not admin and record.get("admin"):
                _not_the_last_admin(content, name)
            record["admin"] = admin
        return record


def _not_the_last_admin(content: dict, name: str) -> None:
    if sum(1 for u in content["users"] if u.get("admin")) <= 1:
        raise LastAdmin(name)


def _named(content: dict, name: str) -> dict:
    record = next((u for u in content["users"] if u["name"].lower() == name.lower()), None)
    if record is None:
        raise BadAccount(f"there is no user named {name!r}")
    return record


class Limiter:
    """The throttle in this process's memory (STORE=files: one process sees every guess).

    key -> {digest of a failed guess, or an Attempt still in flight: when it was counted}.
    """

    MAX_KEYS = 50_000  # a flood of made-up names or addresses cannot grow it without bound

    def __init__(self) -> None:
        self._attempts: dict[str, dict[bytes | Attempt, float]] = {}
        self._turns: dict[str, float] = {}  # key -> monotonic time of its next paced attempt
        self._salt = secrets.token_bytes(16)  # guesses are kept as keyed digests, never as text

    async def reserve(self, limits: list[tuple[str, int | None]], now: float) -> Attempt:
        waits = []
        for key, limit in limits:
            times = self._recent(key, now)
            if limit is not None and len(times) >= limit:
                waits.append(min(times) + WINDOW_SECONDS - now)
        if waits:
            raise Throttled(max(1, math.ceil(max(waits))))
        attempt = Attempt([key for key, _ in limits])
        for key in attempt.keys:
            self._attempts.setdefault(key, {})[attempt] = now
        if len(self._attempts) > self.MAX_KEYS:
            self._attempts = {k: v for k, v in self._attempts.items() if self._recent(k, now)}
            self._turns = {k: t for k, t in self._turns.items() if t > time.monotonic()}
        return attempt

    async def fail(self, attempt: Attempt, guess: str, now: float) -> bool:
        digest = hmac.new(self._salt, guess.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()
        new = False
        for key in attempt.keys:
            seen = self._attempts.setdefault(key, {})
            seen.pop(attempt, None)
            new = new or digest not in seen
            seen[digest] = now
        return new

    async def refund(self, attempt: Attempt) -> None:
        for key in attempt.keys:
            self._attempts.get(key, {}).pop(attempt, None)

    async def clear(self, key: str) -> None:
        self._attempts.pop(key, None)

    async def turn(self, key: str, ceiling: int, spacing: float, now: float) -> float:
        if len(self._recent(key, now)) <= ceiling:
            return 0.0
        moment = time.monotonic()
        start = max(moment, self._turns.get(key, moment))
        self._turns[key] = start + spacing
        return start - moment

    def _recent(self, key: str, now: float) -> list[float]:
        seen = self._attempts.get(key)
        if not seen:
            return []
        for entry in [e for e, t in seen.items() if now - t >= WINDOW_SECONDS]:
            del seen[entry]
        if not seen:
            del self._attempts[key]
        return list(seen.values())


class FileAccountStore:
    """users.json, sessions.json and a throttle in memory: what one process needs.

    Sessions are read once, at start, and this process's copy is written back whole (at most once
    per TOUCH_SECONDS per session for `last_seen`), dropping ended ones: which is why this store
    serves one process, and STORE=redis keeps accounts in Redis.
    """

    def __init__(self, data_dir: Path, idle_seconds: float) -> None:
        self.users_file = UserFile(data_dir)
        self.idle_seconds = idle_seconds
        self.throttle = Limiter()
        self.sessions_path = Path(data_dir) / "sessions.json"
        self._sessions: dict[str, dict] = self._read_sessions()
        self._write_lock = asyncio.Lock()

    # Users.
    async def find_user(self, name: str) -> dict | None:
        return self.users_file.find(name)

    async def users(self) -> list[dict]:
        return list(self.users_file.load()["users"])

    async def add_user(self, name: str, password_hash: str | None, admin: bool, now: float) -> dict:
        return self.users_file.add(name, password_hash, admin, now)

    async def set_password(self, name: str, password_hash: str, *, end_sessions: bool = True) -> None:
        self.users_file.set_password(name, password_hash, end_sessions=end_sessions)
        if end_sessions:
            await self._write_sessions(time.time())  # the old epoch's sessions are dropped

    async def set_admin(self, name: str, admin: bool) -> dict:
        return self.users_file.set_admin(name, admin)

    async def remove_user(self, name: str, *, keep_an_admin: bool = False) -> dict:
        record = self.users_file.remove(name, keep_an_admin)
        await self._write_sessions(time.time())
        return record

    # Sessions.
    async def session(self, digest: str) -> tuple[dict, dict | None] | None:
        record = self._sessions.get(digest)
        if record is None:
            return None
        return record, self.users_file.find(record["username"]) if record["kind"] == "password" else None

    async def save_session(self, digest: str, record: dict, now: float) -> None:
        self._sessions[digest] = record
        await self._write_sessions(now)

    async def touch_session(self, digest: str, record: dict, now: float) -> None:
        if digest in self._sessions:
            self._sessions[digest] = record
            await self._write_sessions(now)

    async def end_session(self, digest: str) -> None:
        if self._sessions.pop(digest, None) is not None:
            await self._write_sessions(time.time())

    def _live(self, record: dict, now: float) -> bool:
        if now - record["last_seen"] > self.idle_seconds:
            return False
        if record["kind"] != "password":
            return True
        user = self.users_file.find(record["username"])
        return user is not None and user.get("epoch") == record.get("epoch")

    def _read_sessions(self) -> dict[str, dict]:
        try:
            stored = orjson.loads(self.sessions_path.read_bytes())
        except FileNotFoundError:
            return {}
        except orjson.JSONDecodeError as exc:
            log.error("%s is damaged (%s): everyone must log in again", self.sessions_path.name, exc)
            return {}
        return dict(stored.get("sessions", {}))

    async def _write_sessions(self, now: float) -> None:
        async with self._write_lock:
            self._sessions = {k: s for k, s in self._sessions.items() if self._live(s, now)}
            data = orjson.dumps({"schema_version": SCHEMA_VERSION, "sessions": self._sessions})
            await asyncio.to_thread(atomic_write, self.sessions_path, data)

    # Migration.
    async def export_accounts(self) -> AccountsDump:
        now = time.time()
        content = self.users_file.load()
        return AccountsDump(users=[dict(u) for u in content["users"]],
                            local_owner_taken=bool(content.get("local_owner_taken")),
                            sessions=[(k, dict(s), s["last_seen"] + self.idle_seconds - now)
                                      for k, s in self._read_sessions().items() if self._live(s, now)])

    async def import_accounts(self, dump: AccountsDump) -> None:
        if not (dump.users or dump.sessions or dump.local_owner_taken):
            return  # no accounts files where there were no accounts
        with self.users_file.edit() as content:
            by_name = {u["name"].lower(): i for i, u in enumerate(content["users"])}
            for user in dump.users:
                at = by_name.get(user["name"].lower())
                if at is None:
                    content["users"].append(dict(user))
                else:
                    content["users"][at] = dict(user)
            content["local_owner_taken"] = bool(content.get("local_owner_taken")) or dump.local_owner_taken
        self._sessions = self._read_sessions()
        self._sessions.update({digest: dict(record) for digest, record, _ in dump.sessions})
        await self._write_sessions(time.time())

    async def close(self) -> None:
        pass
