"""Where accounts live: the account-store protocol (users, sessions, the login throttle) that
`auth.Accounts` works through, and what its two implementations share.

The file implementation (`accounts/files.py`: `DATA_DIR/users.json`, `DATA_DIR/sessions.json`, a
throttle in memory) serves one process, as the file conversation store does; the Redis one
(`accounts/redis.py`) keeps all three in the Redis of `STORE=redis`, under the store's prefix, so
any number of processes share users, sessions and one count of guesses. The composition root
(`app.make_account_store`) picks one; nothing here asks which.

Sessions are stored under the sha256 digest of their id, never the id. Every call that depends on
the time is given it (`now`, the caller's clock), so a test's clock drives every implementation.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Protocol

# Failed guesses allowed in WINDOW before 429: for one name from one address, and from one address
# for any names. A repeated identical guess counts once, so a client retrying a stale password does
# not lock its address out; guesses from one address never lock the name out for another.
FAILURES_PER_USER = 5
FAILURES_PER_ADDRESS = 20
WINDOW_SECONDS = 15 * 60
USERNAME = re.compile(r"[A-Za-z0-9_.@+-]{1,64}")
# The owner id of today's single-person data; the first admin account inherits it.
LOCAL_OWNER = "local"
SCHEMA_VERSION = 1


class Throttled(Exception):
    """Too many failed guesses from this user name or address; retry after `retry_after` seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"too many failed attempts; try again in {retry_after} s")
        self.retry_after = retry_after


class LastAdmin(Exception):
    """The change would leave the accounts without an administrator; nothing was changed."""

    def __init__(self, name: str) -> None:
        super().__init__(f"{name} is the last administrator: make someone else an administrator first")


class BadAccount(ValueError):
    """A user change that cannot be made (bad name, taken name, short password, unknown user)."""


def check_new_name(name: str) -> None:
    if not USERNAME.fullmatch(name):
        raise BadAccount(f"user names are 1-64 of A-Z a-z 0-9 _ . @ + -, not {name!r}")
    if name.lower() == LOCAL_OWNER:
        raise BadAccount(f"the name {LOCAL_OWNER!r} is reserved for the one person of AUTH=none")


def new_user_record(name: str, password_hash: str | None, admin: bool, now: float, *, inherits: bool) -> dict:
    """A user's stored record; `inherits`: the first admin ever made takes the single-person data."""
    return {"name": name, "admin": admin, "password_hash": password_hash, "created_at": iso(now),
            "owner": LOCAL_OWNER if inherits else f"u-{secrets.token_hex(8)}", "epoch": secrets.token_hex(8)}


def iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


class Attempt:
    """One guess counted against its keys from the moment it was reserved until settled or refunded."""

    __slots__ = ("keys", "token")

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.token = secrets.token_hex(8)  # names the in-flight count where the count is shared


class Throttle(Protocol):
    """Attempts per key (a name from an address, an address, a name) in a sliding WINDOW_SECONDS.

    An attempt is reserved before its guess is checked, so concurrent guesses cannot all pass the
    check before the first of them fails; only a right guess gives its reservation back. Wrong
    guesses are kept as keyed digests, never as text, so repeating one counts it once.
    """

    async def reserve(self, limits: list[tuple[str, int | None]], now: float) -> Attempt:
        """Count one attempt against every key; Throttled when a key with a limit has used it up.
        A key whose limit is None is counted but never refuses (the per-name ceiling, see `turn`)."""
        ...

    async def fail(self, attempt: Attempt, guess: str, now: float) -> bool:
        """The attempt was a wrong guess; False when it repeats a guess already counted (it then counts once)."""
        ...

    async def refund(self, attempt: Attempt) -> None:
        """The attempt was right: it counts against nothing."""
        ...

    async def clear(self, key: str) -> None: ...

    async def turn(self, key: str, ceiling: int, spacing: float, now: float) -> float:
        """Seconds to wait before this attempt: past `ceiling` attempts on `key`, they go `spacing` apart."""
        ...


@dataclass(slots=True)
class AccountsDump:
    """Everything an account store holds, for `migrate`: users as stored, whether a user has taken
    the single-person data, and each live session as (digest, record, seconds it has left)."""

    users: list[dict] = field(default_factory=list)
    local_owner_taken: bool = False
    sessions: list[tuple[str, dict, float]] = field(default_factory=list)


class AccountStore(Protocol):
    """Users, sessions and the throttle of one deployment.

    A user record: `name`, `admin`, `password_hash` (None for AUTH=header users), `created_at`,
    `owner` (never changes, never reused), `epoch` (a new one ends every session of the user).
    A session record: `username`, `kind` ("password" or "token"), `epoch`, `created`, `last_seen`.
    A session is live SESSION_HOURS (`idle_seconds`) after its last recorded `last_seen`.
    """

    throttle: Throttle
    idle_seconds: float

    async def find_user(self, name: str) -> dict | None:
        """The user named so (names are case-insensitive), or None."""
        ...

    async def users(self) -> list[dict]:
        """Every user, oldest first."""
        ...

    async def add_user(self, name: str, password_hash: str | None, admin: bool, now: float) -> dict:
        """A new account (BadAccount for a bad or taken name); the first admin ever made inherits
        the single-person data (owner "local"), later ones never do."""
        ...

    async def set_password(self, name: str, password_hash: str, *, end_sessions: bool = True) -> None:
        """Change a password; unless told otherwise a new epoch ends every session the user had."""
        ...

    async def remove_user(self, name: str, *, keep_an_admin: bool = False) -> dict:
        """Remove the account and end its sessions; its record (BadAccount when there is none).
        `keep_an_admin`: refuse (LastAdmin) to remove the last administrator."""
        ...

    async def set_admin(self, name: str, admin: bool) -> dict:
        """Promote or demote; the record as stored (BadAccount: no such user; LastAdmin: it would
        leave no administrator, and nothing changed)."""
        ...

    async def session(self, digest: str) -> tuple[dict, dict | None] | None:
        """The session stored under `digest` and the user record it names (None: no such user), or None."""
        ...

    async def save_session(self, digest: str, record: dict, now: float) -> None:
        """Store a new session, live `idle_seconds` from its `last_seen`."""
        ...

    async def touch_session(self, digest: str, record: dict, now: float) -> None:
        """Record a session's new `last_seen`, pushing its end back; a session ended meanwhile stays ended."""
        ...

    async def end_session(self, digest: str) -> None: ...

    async def export_accounts(self) -> AccountsDump: ...

    async def import_accounts(self, dump: AccountsDump) -> None:
        """Add or replace (by name, by digest) what the dump holds; what it does not hold is left alone."""
        ...

    async def close(self) -> None: ...
