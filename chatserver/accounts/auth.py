"""Who is asking: accounts, login sessions, login throttling, and the one `authenticate` call.

Promises: `Accounts.authenticate(scope, headers)` names the `User` behind a request (or None),
for every AUTH mode; sessions are random ids of which only a sha256 is kept, expire after
SESSION_HOURS idle and survive a restart; failed logins are throttled and logged, each guess
counted before it is checked; a wrong name and a wrong password cost one argon2 verification
each and read the same. Where a request comes from is decided from its TCP peer alone
(`request_origin`): X-Forwarded-* headers count only from TRUSTED_PROXIES.
Does not know: what a user owns (the store scopes data by `User.owner`) or which routes exist.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import hmac
import ipaddress
import logging
import math
import re
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from fastapi import HTTPException, Request

from chatserver.config import Settings
from chatserver.store.files import atomic_write

log = logging.getLogger("chat.auth")

SESSION_COOKIE = "chat_session"
TOKEN_COOKIE = "chat_token"
USERNAME = re.compile(r"[A-Za-z0-9_.@+-]{1,64}")
MIN_PASSWORD_CHARS = 8
# Failed guesses allowed in WINDOW before 429: for one name from one address, and from one address
# for any names. A repeated identical guess counts once, so a client retrying a stale password does
# not lock its address out; guesses from one address never lock the name out for another.
FAILURES_PER_USER = 5
FAILURES_PER_ADDRESS = 20
WINDOW_SECONDS = 15 * 60
# Past this many guesses at one name from all addresses in WINDOW, its logins are paced (one per
# NAME_PACE_SECONDS) rather than refused: many addresses guess slowly, and the owner still gets in.
NAME_CEILING = 20
NAME_PACE_SECONDS = 2.0
# last_seen is written at most this often per session: sliding expiry without a write per request.
TOUCH_SECONDS = 60
# Each argon2 verification holds 64 MiB; a flood of logins must not hold gigabytes.
CONCURRENT_VERIFICATIONS = 2
# The owner id of today's single-person data; the first admin account inherits it.
LOCAL_OWNER = "local"
SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class User:
    """A person the server recognised; `owner` scopes their data and never changes or gets reused."""

    name: str
    admin: bool
    owner: str


LOCAL = User(LOCAL_OWNER, admin=True, owner=LOCAL_OWNER)


class Throttled(Exception):
    """Too many failed guesses from this user name or address; retry after `retry_after` seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"too many failed attempts; try again in {retry_after} s")
        self.retry_after = retry_after


class WrongCredentials(Exception):
    """The one answer for an unknown user, a wrong password and a wrong token."""


class BadAccount(ValueError):
    """A user-file change that cannot be made (bad name, taken name, short password, unknown user)."""


# --- Users: DATA_DIR/users.json, shared by the server and `python server.py user ...` -----------

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
        if not USERNAME.fullmatch(name):
            raise BadAccount(f"user names are 1-64 of A-Z a-z 0-9 _ . @ + -, not {name!r}")
        if name.lower() == LOCAL_OWNER:
            raise BadAccount(f"the name {LOCAL_OWNER!r} is reserved for the one person of AUTH=none")
        with self.edit() as content:
            if any(u["name"].lower() == name.lower() for u in content["users"]):
                raise BadAccount(f"there is already a user named {name!r}")
            inherits = admin and not content.get("local_owner_taken")
            record = {"name": name, "admin": admin, "password_hash": password_hash,
                      "created_at": _iso(now), "owner": LOCAL_OWNER if inherits else f"u-{secrets.token_hex(8)}",
                      "epoch": secrets.token_hex(8)}
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

    def remove(self, name: str) -> dict:
        with self.edit() as content:
            record = _named(content, name)
            content["users"].remove(record)
        return record


def _named(content: dict, name: str) -> dict:
    record = next((u for u in content["users"] if u["name"].lower() == name.lower()), None)
    if record is None:
        raise BadAccount(f"there is no user named {name!r}")
    return record


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


# --- Throttling -------------------------------------------------------------------------------

class Attempt:
    """One guess counted against its keys from the moment it was reserved until settled or refunded."""

    __slots__ = ("keys",)

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys


class Limiter:
    """Attempts per key (a name from an address, an address) in a sliding window, in memory.

    An attempt is reserved before its guess is checked, so concurrent guesses cannot all pass the
    check before the first of them fails; only a right guess gives its reservation back.
    """

    MAX_KEYS = 50_000  # a flood of made-up names or addresses cannot grow it without bound

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        # key -> {digest of a failed guess, or an Attempt still in flight: when it was counted}
        self._attempts: dict[str, dict[bytes | Attempt, float]] = {}
        self._turns: dict[str, float] = {}  # key -> monotonic time of its next paced attempt
        self._salt = secrets.token_bytes(16)  # guesses are kept as keyed digests, never as text

    def reserve(self, limits: list[tuple[str, int | None]]) -> Attempt:
        """Count one attempt against every key; Throttled when a key with a limit has used it up.

        A key whose limit is None is counted but never refuses (the per-name ceiling, see `turn`).
        """
        now = self.clock()
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

    def fail(self, attempt: Attempt, guess: str) -> bool:
        """The attempt was a wrong guess; False when it repeats a guess already counted (it then counts once)."""
        now = self.clock()
        digest = hmac.new(self._salt, guess.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()
        new = False
        for key in attempt.keys:
            seen = self._attempts.setdefault(key, {})
            seen.pop(attempt, None)
            new = new or digest not in seen
            seen[digest] = now
        return new

    def refund(self, attempt: Attempt) -> None:
        """The attempt was right: it counts against nothing."""
        for key in attempt.keys:
            self._attempts.get(key, {}).pop(attempt, None)

    def clear(self, key: str) -> None:
        self._attempts.pop(key, None)

    def turn(self, key: str, ceiling: int, spacing: float) -> float:
        """Seconds to wait before this attempt: past `ceiling` attempts on `key`, they go `spacing` apart."""
        if len(self._recent(key, self.clock())) <= ceiling:
            return 0.0
        now = time.monotonic()
        start = max(now, self._turns.get(key, now))
        self._turns[key] = start + spacing
        return start - now

    def _recent(self, key: str, now: float) -> list[float]:
        seen = self._attempts.get(key)
        if not seen:
            return []
        for entry in [e for e, t in seen.items() if now - t >= WINDOW_SECONDS]:
            del seen[entry]
        if not seen:
            del self._attempts[key]
        return list(seen.values())


# --- Requests ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Origin:
    """Where one request comes from, decided once from its TCP peer (`request_origin`)."""

    address: str  # the TCP peer, or behind a trusted proxy the address that proxy appended
    via_proxy: bool  # the TCP peer is in TRUSTED_PROXIES: its X-Forwarded-* headers are believed
    https: bool  # the browser's connection: ours, or the trusted proxy's (X-Forwarded-Proto)
    forwarded_user: str | None  # AUTH_HEADER's value, from a trusted proxy only


# Throttles and logs use this for a request whose peer a server in front took from its own
# X-Forwarded-For: the address is invented by whoever sent the header, so all such requests share one.
REWRITTEN_PEER = "unknown (peer address rewritten from X-Forwarded-For in front of the app)"
_warned_rewrite = False


def request_origin(scope: dict, settings: Settings) -> Origin:
    """The request's Origin, worked out on first use and kept in the scope for the rest of the request."""
    state = scope.setdefault("state", {})
    found = state.get("chat_origin")
    if found is None:
        found = state["chat_origin"] = _origin(scope, settings)
    return found


def _origin(scope: dict, settings: Settings) -> Origin:
    client = scope.get("client")
    tcp_peer = client[0] if client else ""
    values: dict[str, list[str]] = {}
    for key, value in scope["headers"]:
        values.setdefault(key.decode("latin-1").lower(), []).append(value.decode("latin-1"))
    forwarded_for = [e.strip() for v in values.get("x-forwarded-for", []) for e in v.split(",")]
    if tcp_peer and tcp_peer in map(_without_port, forwarded_for):
        # uvicorn's proxy_headers (on unless told otherwise, `uvicorn server:app`) already replaced
        # the peer with an entry of the header: the real peer is unknown, so nothing is believed.
        _warn_rewritten()
        return Origin(REWRITTEN_PEER, via_proxy=False, https=False, forwarded_user=None)
    scheme_https = scope.get("scheme") == "https"
    if not _is_trusted_proxy(tcp_peer, settings):
        # A scheme of https with an X-Forwarded-Proto beside it may be the header's, not ours.
        return Origin(tcp_peer, via_proxy=False, https=scheme_https and "x-forwarded-proto" not in values,
                      forwarded_user=None)
    appended = forwarded_for[-1] if forwarded_for else ""
    address = appended if _is_address(appended) else tcp_peer
    proto = [e.strip().lower() for v in values.get("x-forwarded-proto", []) for e in v.split(",")]
    users = values.get(settings.auth_header.lower(), [])
    return Origin(address, via_proxy=True, https=scheme_https or (proto[-1:] == ["https"]),
                  forwarded_user=users[0].strip() if len(users) == 1 else None)


def _without_port(entry: str) -> str:
    """An X-Forwarded-For entry's host, as uvicorn reads it (`1.2.3.4:80`, `[::1]:80`)."""
    if entry.startswith("["):
        return entry[1:entry.find("]")] if "]" in entry else entry
    return entry.partition(":")[0] if entry.count(":") == 1 else entry


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _is_trusted_proxy(tcp_peer: str, settings: Settings) -> bool:
    try:
        address = ipaddress.ip_address(tcp_peer)
    except ValueError:
        return False
    return any(address in ipaddress.ip_network(p, strict=False) for p in settings.trusted_proxies)


def _warn_rewritten() -> None:
    global _warned_rewrite
    if not _warned_rewrite:
        _warned_rewrite = True
        log.error("the server in front of the app rewrote the client address from X-Forwarded-For, so "
                  "forwarded headers and AUTH=header are ignored and such requests share one throttle: "
                  "start it with `python server.py`, or uvicorn with --no-proxy-headers (README)")


def cookie(headers: dict, name: str) -> str | None:
    for part in headers.get("cookie", "").split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return None


def unauthorised_detail(settings: Settings) -> str:
    if settings.auth == "password":
        return "log in first (POST /api/auth/login)"
    if settings.auth == "header":
        return f"no trusted {settings.auth_header} header: sign in through the proxy"
    return "this server needs its access token (Authorization: Bearer, or log in on the page)"


# --- Accounts: the server side ----------------------------------------------------------------

class Accounts:
    """Users, sessions and the limiter of one running server."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.time,
                 hasher: PasswordHasher | None = None) -> None:
        self.settings = settings
        self.clock = clock
        self.hasher = hasher or PasswordHasher()
        self.users = UserFile(settings.data_dir)
        self.limiter = Limiter(clock)
        self.sessions_path = Path(settings.data_dir) / "sessions.json"
        self._sessions: dict[str, dict] = self._read_sessions()
        self._persisted_seen = {k: s["last_seen"] for k, s in self._sessions.items()}
        self._write_lock = asyncio.Lock()
        self._verifications = asyncio.Semaphore(CONCURRENT_VERIFICATIONS)
        # Unknown names verify against this, so they cost what a known name costs from the first try.
        self._dummy_hash = self.hasher.hash(secrets.token_urlsafe(16)) if settings.auth == "password" else None

    # The one call every guarded request goes through.
    async def authenticate(self, scope: dict, headers: dict) -> User | None:
        """The user behind this request, or None. Raises Throttled for a wrong bearer token past the limit.

        `headers` maps lower-cased names to values (the Guard's dict).
        """
        mode = self.settings.auth
        if mode == "header":
            return self._header_user(request_origin(scope, self.settings))
        if mode == "password":
            record = await self._session(cookie(headers, SESSION_COOKIE), "password")
            return self._account_user(record) if record else None
        token = self.settings.access_token
        if token is None:
            return LOCAL
        authorization = headers.get("authorization", "")
        if authorization[:7].lower() == "bearer ":
            offered = authorization[7:].strip()
            if await self._token_guess(offered, request_origin(scope, self.settings).address):
                return LOCAL
            return None
        return LOCAL if await self._session(cookie(headers, TOKEN_COOKIE), "token") else None

    async def login(self, username: str, password: str, address: str) -> str:
        """A new session id for a right name and password; WrongCredentials or Throttled otherwise."""
        name = f"user:{username.lower()}"
        attempt = self.limiter.reserve([(f"{name} address:{address}", FAILURES_PER_USER),
                                        (f"address:{address}", FAILURES_PER_ADDRESS), (name, None)])
        wait = self.limiter.turn(name, NAME_CEILING, NAME_PACE_SECONDS)
        if wait:
            await asyncio.sleep(wait)
        record = self.users.find(username) if USERNAME.fullmatch(username) else None
        stored = record.get("password_hash") if record else None
        # Unknown names verify against a dummy hash: the same work, so the same time.
        right = await self._verify(stored or self._dummy_hash, password) and stored is not None
        if not right:
            if self.limiter.fail(attempt, f"{username.lower()}\0{password}"):
                log.warning("failed login for user %r from %s", username, address)
            raise WrongCredentials
        self.limiter.refund(attempt)
        self.limiter.clear(attempt.keys[0])
        log.info("user %r logged in from %s", record["name"], address)
        if self.hasher.check_needs_rehash(stored):
            rehashed = await asyncio.to_thread(self.hasher.hash, password)
            self.users.set_password(record["name"], rehashed, end_sessions=False)
            record = self.users.find(record["name"])
        return await self._new_session(record["name"], "password", record["epoch"])

    async def login_token(self, offered: str, address: str) -> str:
        """A new session id for the right ACCESS_TOKEN; WrongCredentials or Throttled otherwise."""
        if not await self._token_guess(offered, address):
            raise WrongCredentials
        return await self._new_session(LOCAL_OWNER, "token", "")

    async def logout(self, session_id: str | None) -> None:
        if session_id and self._sessions.pop(_digest(session_id), None) is not None:
            await self._write_sessions()

    # --- inside

    def _header_user(self, origin: Origin) -> User | None:
        name = origin.forwarded_user  # None unless a trusted proxy sent the header exactly once
        if name is None or not USERNAME.fullmatch(name) or name.lower() == LOCAL_OWNER:
            return None
        record = self.users.find(name)
        if record is None:
            try:
                record = self.users.add(name, None, name.lower() in self.settings.admin_users, self.clock())
                log.info("new user %r, named by the proxy", name)
            except BadAccount:  # another process added it a moment ago
                record = self.users.find(name)
        return self._user(record)

    def _account_user(self, session: dict) -> User | None:
        record = self.users.find(session["username"])
        if record is None or record.get("epoch") != session.get("epoch"):
            return None  # removed, or the password changed since this session began
        return self._user(record)

    def _user(self, record: dict) -> User:
        admin = bool(record.get("admin")) or record["name"].lower() in self.settings.admin_users
        return User(record["name"], admin, record["owner"])

    async def _token_guess(self, offered: str, address: str) -> bool:
        attempt = self.limiter.reserve([(f"address:{address}", FAILURES_PER_ADDRESS)])
        if hmac.compare_digest(offered.encode("utf-8", "surrogatepass"), self.settings.access_token.encode()):
            self.limiter.refund(attempt)
            return True
        if self.limiter.fail(attempt, offered):
            log.warning("wrong access token from %s", address)
        return False

    async def _verify(self, stored: str, password: str) -> bool:
        async with self._verifications:
            try:
                return await asyncio.to_thread(self.hasher.verify, stored, password)
            except (VerificationError, InvalidHashError):
                return False

    async def _new_session(self, username: str, kind: str, epoch: str) -> str:
        session_id = secrets.token_urlsafe(32)
        now = self.clock()
        self._sessions[_digest(session_id)] = {"username": username, "kind": kind, "epoch": epoch,
                                               "created": now, "last_seen": now}
        await self._write_sessions()
        return session_id

    async def _session(self, session_id: str | None, kind: str) -> dict | None:
        """The live session record for this id, its idle clock restarted; None when unknown or expired."""
        if not session_id:
            return None
        key = _digest(session_id)
        record = self._sessions.get(key)
        if record is None or record["kind"] != kind:
            return None
        now = self.clock()
        if now - record["last_seen"] > self.settings.session_hours * 3600:
            del self._sessions[key]
            await self._write_sessions()
            return None
        record["last_seen"] = now
        if now - self._persisted_seen.get(key, 0) >= TOUCH_SECONDS:
            await self._write_sessions()
        return record

    def _read_sessions(self) -> dict[str, dict]:
        try:
            stored = orjson.loads(self.sessions_path.read_bytes())
        except FileNotFoundError:
            return {}
        except orjson.JSONDecodeError as exc:
            log.error("%s is damaged (%s): everyone must log in again", self.sessions_path.name, exc)
            return {}
        return dict(stored.get("sessions", {}))

    async def _write_sessions(self) -> None:
        async with self._write_lock:
            now = self.clock()
            limit = self.settings.session_hours * 3600
            live = {k: s for k, s in self._sessions.items() if now - s["last_seen"] <= limit
                    and (s["kind"] != "password" or self._account_user(s) is not None)}
            self._sessions = live
            self._persisted_seen = {k: s["last_seen"] for k, s in live.items()}
            data = orjson.dumps({"schema_version": SCHEMA_VERSION, "sessions": live})
            await asyncio.to_thread(atomic_write, self.sessions_path, data)


def _digest(session_id: str) -> str:
    return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()


def remove_sessions_of(data_dir: Path, name: str) -> None:
    """Drop a user's sessions from sessions.json (the CLI, for a server that is not running)."""
    path = Path(data_dir) / "sessions.json"
    try:
        stored = orjson.loads(path.read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return
    sessions = {k: s for k, s in stored.get("sessions", {}).items()
                if not (s.get("kind") == "password" and s.get("username", "").lower() == name.lower())}
    atomic_write(path, orjson.dumps({"schema_version": SCHEMA_VERSION, "sessions": sessions}))


def accounts(app) -> Accounts:
    """The app's Accounts, which lifespan made (its dummy hash included) before the first request."""
    return app.state.accounts


async def current_user(request: Request) -> User:
    """FastAPI dependency: the user the Guard recognised (authenticating again if it did not run)."""
    user = request.scope.get("state", {}).get("chat_user")
    if user is None:
        try:
            user = await accounts(request.app).authenticate(request.scope, _headers(request.scope))
        except Throttled as exc:
            raise HTTPException(429, str(exc), headers={"Retry-After": str(exc.retry_after)}) from None
    if user is None:
        raise HTTPException(401, unauthorised_detail(request.app.state.chat.settings))
    return user


def _headers(scope: dict) -> dict:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}

