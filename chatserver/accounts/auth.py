"""Who is asking: accounts, login sessions, login throttling, and the one `authenticate` call.

Promises: `Accounts.authenticate(scope, headers)` names the `User` behind a request (or None),
for every AUTH mode; sessions are random ids of which only a sha256 is kept, expire after
SESSION_HOURS idle and survive a restart; failed logins are throttled and logged, each guess
counted before it is checked; a wrong name and a wrong password cost one argon2 verification
each and read the same. Users, sessions and the throttle's counts live in the `AccountStore`
it is given (accounts/store.py): files for one process, or the Redis every server shares.
Where a request comes from is decided from its TCP peer alone (`request_origin`): X-Forwarded-*
headers count only from TRUSTED_PROXIES.
Does not know: what a user owns (the store scopes data by `User.owner`) or which routes exist.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from fastapi import HTTPException, Request

# UserFile and WINDOW_SECONDS are named here too, where the tests and older callers look for them.
from chatserver.accounts.files import UserFile as UserFile
from chatserver.accounts.store import (
    FAILURES_PER_ADDRESS,
    FAILURES_PER_USER,
    LOCAL_OWNER,
    USERNAME,
    AccountStore,
    BadAccount,
    Throttled,
)
from chatserver.accounts.store import WINDOW_SECONDS as WINDOW_SECONDS
from chatserver.config import Settings

log = logging.getLogger("chat.auth")

SESSION_COOKIE = "chat_session"
TOKEN_COOKIE = "chat_token"
MIN_PASSWORD_CHARS = 8
# Past this many guesses at one name from all addresses in WINDOW, its logins are paced (one per
# NAME_PACE_SECONDS) rather than refused: many addresses guess slowly, and the owner still gets in.
NAME_CEILING = 20
NAME_PACE_SECONDS = 2.0
# last_seen is written at most this often per session: sliding expiry without a write per request.
TOUCH_SECONDS = 60
# Each argon2 verification holds 64 MiB; a flood of logins must not hold gigabytes.
CONCURRENT_VERIFICATIONS = 2


@dataclass(frozen=True, slots=True)
class User:
    """A person the server recognised; `owner` scopes their data and never changes or gets reused."""

    name: str
    admin: bool
    owner: str


LOCAL = User(LOCAL_OWNER, admin=True, owner=LOCAL_OWNER)


class WrongCredentials(Exception):
    """The one answer for an unknown user, a wrong password and a wrong token."""


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
    """Who is who for one running server, through the account store STORE names (`store`)."""

    def __init__(self, settings: Settings, store: AccountStore, clock: Callable[[], float] = time.time,
                 hasher: PasswordHasher | None = None) -> None:
        self.settings = settings
        self.store = store
        self.clock = clock
        self.hasher = hasher or PasswordHasher()
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
            return await self._header_user(request_origin(scope, self.settings))
        if mode == "password":
            return await self._session(cookie(headers, SESSION_COOKIE), "password")
        token = self.settings.access_token
        if token is None:
            return LOCAL
        authorization = headers.get("authorization", "")
        if authorization[:7].lower() == "bearer ":
            offered = authorization[7:].strip()
            if await self._token_guess(offered, request_origin(scope, self.settings).address):
                return LOCAL
            return None
        return await self._session(cookie(headers, TOKEN_COOKIE), "token")

    async def login(self, username: str, password: str, address: str) -> str:
        """A new session id for a right name and password; WrongCredentials or Throttled otherwise."""
        name = f"user:{username.lower()}"
        throttle = self.store.throttle
        attempt = await throttle.reserve([(f"{name} address:{address}", FAILURES_PER_USER),
                                          (f"address:{address}", FAILURES_PER_ADDRESS), (name, None)], self.clock())
        wait = await throttle.turn(name, NAME_CEILING, NAME_PACE_SECONDS, self.clock())
        if wait:
            await asyncio.sleep(wait)
        record = await self.store.find_user(username) if USERNAME.fullmatch(username) else None
        stored = record.get("password_hash") if record else None
        # Unknown names verify against a dummy hash: the same work, so the same time.
        right = await self._verify(stored or self._dummy_hash, password) and stored is not None
        if not right or record is None:
            if await throttle.fail(attempt, f"{username.lower()}\0{password}", self.clock()):
                log.warning("failed login for user %r from %s", username, address)
            raise WrongCredentials
        await throttle.refund(attempt)
        await throttle.clear(attempt.keys[0])
        log.info("user %r logged in from %s", record["name"], address)
        if stored is not None and self.hasher.check_needs_rehash(stored):
            rehashed = await asyncio.to_thread(self.hasher.hash, password)
            await self.store.set_password(record["name"], rehashed, end_sessions=False)
            record = await self.store.find_user(record["name"]) or record
        return await self._new_session(record["name"], "password", record["epoch"])

    async def login_token(self, offered: str, address: str) -> str:
        """A new session id for the right ACCESS_TOKEN; WrongCredentials or Throttled otherwise."""
        if not await self._token_guess(offered, address):
            raise WrongCredentials
        return await self._new_session(LOCAL_OWNER, "token", "")

    async def logout(self, session_id: str | None) -> None:
        if session_id:
            await self.store.end_session(_digest(session_id))

    # --- inside

    async def _header_user(self, origin: Origin) -> User | None:
        name = origin.forwarded_user  # None unless a trusted proxy sent the header exactly once
        if name is None or not USERNAME.fullmatch(name) or name.lower() == LOCAL_OWNER:
            return None
        record = await self.store.find_user(name)
        if record is None:
            try:
                record = await self.store.add_user(name, None, name.lower() in self.settings.admin_users, self.clock())
                log.info("new user %r, named by the proxy", name)
            except BadAccount:  # another process added it a moment ago
                record = await self.store.find_user(name)
        return self._user(record) if record is not None else None

    def _user(self, record: dict) -> User:
        admin = bool(record.get("admin")) or record["name"].lower() in self.settings.admin_users
        return User(record["name"], admin, record["owner"])

    async def _token_guess(self, offered: str, address: str) -> bool:
        throttle = self.store.throttle
        attempt = await throttle.reserve([(f"address:{address}", FAILURES_PER_ADDRESS)], self.clock())
        token = self.settings.access_token or ""
        if token and hmac.compare_digest(offered.encode("utf-8", "surrogatepass"), token.encode()):
            await throttle.refund(attempt)
            return True
        if await throttle.fail(attempt, offered, self.clock()):
            log.warning("wrong access token from %s", address)
        return False

    async def _verify(self, stored: str | None, password: str) -> bool:
        if stored is None:
            return False
        async with self._verifications:
            try:
                return await asyncio.to_thread(self.hasher.verify, stored, password)
            except (VerificationError, InvalidHashError):
                return False

    async def _new_session(self, username: str, kind: str, epoch: str) -> str:
        session_id = secrets.token_urlsafe(32)
        now = self.clock()
        await self.store.save_session(_digest(session_id), {"username": username, "kind": kind, "epoch": epoch,
                                                            "created": now, "last_seen": now}, now)
        return session_id

    async def _session(self, session_id: str | None, kind: str) -> User | None:
        """The user of a live session of this kind, its idle clock restarted; None when unknown or ended.

        A password session ends with its user's removal or a new epoch (a changed password)."""
        if not session_id:
            return None
        key = _digest(session_id)
        found = await self.store.session(key)
        if found is None:
            return None
        record, account = found
        if record.get("kind") != kind:
            return None
        now = self.clock()
        if now - record["last_seen"] > self.store.idle_seconds:
            await self.store.end_session(key)
            return None
        if kind == "password":
            if account is None or account.get("epoch") != record.get("epoch"):
                return None  # removed, or the password changed since this session began
            user = self._user(account)
        else:
            user = LOCAL
        if now - record["last_seen"] >= TOUCH_SECONDS:
            await self.store.touch_session(key, {**record, "last_seen": now}, now)
        return user


def _digest(session_id: str) -> str:
    return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()


def accounts(app) -> Accounts:
    """The app's Accounts, which lifespan made (its dummy hash included) before the first request."""
    return app.state.accounts


async def current_user(request: Request) -> User:
    """FastAPI dependency: the user the Guard recognised (authenticating again if it did not run)."""
    user = request.scope.get("state", {}).get("chat_user")
    if user is None:
        try:
            scope = cast(dict, request.scope)  # the ASGI scope itself: the origin is kept in it
            user = await accounts(request.app).authenticate(scope, _headers(scope))
        except Throttled as exc:
            raise HTTPException(429, str(exc), headers={"Retry-After": str(exc.retry_after)}) from None
    if user is None:
        raise HTTPException(401, unauthorised_detail(request.app.state.chat.settings))
    return user


def _headers(scope: dict) -> dict:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}

