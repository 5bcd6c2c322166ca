"""The person's ledger: one record per upstream request (a charge), kept per calendar month (UTC).

A charge's id starts with its month (`2026-12.<token>`), so a later correction (reconciliation)
replaces it in place. On Redis every server shares it: a hash per person and month, beside a
running sum of the month's cost (kept by the same script that replaces a charge, so a budget is
one read); charges whose cost is still to be asked of the gateway wait in a set any server's
reconciler drains. On files (one process) each month is an append-only JSON-lines file, the
last line of an id winning. Small settings (prices, budgets) are JSON values beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import orjson

from chatserver.store.files import write_synced

SOURCES = ("reported", "reconciled", "priced", "estimated", "unreported")


def month_of(at: dt.datetime) -> str:
    return at.astimezone(dt.UTC).strftime("%Y-%m")


def new_charge_id(at: dt.datetime) -> str:
    return f"{month_of(at)}.{secrets.token_urlsafe(12)}"


def months_between(start: dt.datetime, end: dt.datetime) -> list[str]:
    """Every month from `start`'s to `end`'s, inclusive."""
    year, month = start.year, start.month
    out = []
    while (year, month) <= (end.year, end.month):
        out.append(f"{year:04d}-{month:02d}")
        year, month = (year + 1, 1) if month == 12 else (year, month + 1)
    return out


class Ledger(Protocol):
    async def put(self, owner: str, charge: dict) -> None:
        """Add a charge, or replace the one with its id."""

    async def get(self, owner: str, charge_id: str) -> dict | None: ...

    async def month(self, owner: str, month: str) -> list[dict]: ...

    async def month_spent(self, owner: str, month: str) -> float: ...

    async def months(self, owner: str) -> list[str]:
        """The months this person has charges in, oldest first."""

    async def owners(self) -> list[str]: ...

    async def wait_for_gateway(self, owner: str, charge_id: str) -> None:
        """Note that this charge's cost is to be asked of the gateway (by any server)."""

    async def settled(self, owner: str, charge_id: str) -> None: ...

    async def waiting(self) -> list[tuple[str, str]]: ...

    async def read_setting(self, name: str) -> dict: ...

    async def write_setting(self, name: str, value: dict) -> None: ...

    async def close(self) -> None: ...


def spent(charges: Iterable[dict]) -> float:
    """What charges cost; an unknown cost adds nothing (it is counted apart, never as zero)."""
    return round(sum(c["cost"] for c in charges if c.get("cost") is not None), 10)


class FileLedger:
    """DATA_DIR/ledger/<owner as hex>/<month>.jsonl, for the one process the file store serves."""

    def __init__(self, data_dir: Path) -> None:
        self.root = data_dir / "ledger"
        self._months: dict[tuple[str, str], dict[str, dict]] = {}
        # Each month's sum, kept as charges come and go: a turn reads it, and summing the month's
        # charges instead grew with every turn of the month.
        self._spent: dict[tuple[str, str], float] = {}
        self._settings: dict[str, dict] = {}
        self._appends = GroupAppender()
        self._waiting_lock = asyncio.Lock()  # the waiting list is read, changed and written whole

    def _dir(self, owner: str) -> Path:
        return self.root / owner.encode().hex()

    def _file(self, owner: str, month: str) -> Path:
        return self._dir(owner) / f"{month}.jsonl"

    def _load(self, owner: str, month: str) -> dict[str, dict]:
        key = (owner, month)
        if key not in self._months:
            charges: dict[str, dict] = {}
            try:
                with self._file(owner, month).open("rb") as f:
                    for line in f:
                        try:
                            charge = orjson.loads(line)
                        except orjson.JSONDecodeError:
                            continue  # a line torn by a crash mid-append
                        charges[charge["id"]] = charge
            except FileNotFoundError:
                pass
            self._months[key] = charges
            self._spent[key] = spent(charges.values())
        return self._months[key]

    async def put(self, owner: str, charge: dict) -> None:
        month = charge["id"].split(".", 1)[0]
        charges = self._load(owner, month)
        before = charges.get(charge["id"])
        charges[charge["id"]] = charge
        self._spent[owner, month] += (charge.get("cost") or 0) - ((before or {}).get("cost") or 0)
        await self._appends.append(self._file(owner, month), orjson.dumps(charge) + b"\n")

    async def get(self, owner: str, charge_id: str) -> dict | None:
        return self._load(owner, charge_id.split(".", 1)[0]).get(charge_id)

    async def month(self, owner: str, month: str) -> list[dict]:
        return list(self._load(owner, month).values())

    async def month_spent(self, owner: str, month: str) -> float:
        self._load(owner, month)
        return round(self._spent[owner, month], 10)

    async def months(self, owner: str) -> list[str]:
        folder = self._dir(owner)
        return sorted(p.stem for p in folder.glob("*.jsonl")) if folder.is_dir() else []

    async def owners(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(bytes.fromhex(p.name).decode() for p in self.root.iterdir() if p.is_dir())

    def _setting_path(self, name: str) -> Path:
        return self.root / f"{name}.json"

    async def wait_for_gateway(self, owner: str, charge_id: str) -> None:
        async with self._waiting_lock:
            waiting = await self.read_setting("waiting")
            waiting[f"{owner} {charge_id}"] = True
            await self.write_setting("waiting", waiting)

    async def settled(self, owner: str, charge_id: str) -> None:
        async with self._waiting_lock:
            waiting = await self.read_setting("waiting")
            if waiting.pop(f"{owner} {charge_id}", None):
                await self.write_setting("waiting", waiting)

    async def waiting(self) -> list[tuple[str, str]]:
        return [tuple(k.split(" ", 1)) for k in await self.read_setting("waiting")]

    async def read_setting(self, name: str) -> dict:
        """The setting as a dict of its own (change it freely). Read from its file once: only this
        process writes it (the file store serves one), and a turn reads prices and budgets."""
        if name not in self._settings:
            try:
                value = orjson.loads(self._setting_path(name).read_bytes())
            except (FileNotFoundError, orjson.JSONDecodeError):
                value = {}
            self._settings[name] = value if isinstance(value, dict) else {}
        return dict(self._settings[name])

    async def write_setting(self, name: str, value: dict) -> None:
        from chatserver.store.files import atomic_write

        self.root.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(atomic_write, self._setting_path(name), orjson.dumps(value))
        self._settings[name] = dict(value)

    async def close(self) -> None:
        return None


class GroupAppender:
    """Appends lines to files and fsyncs them, the appends that arrive meanwhile together.

    One worker-thread hand-off and one fsync per file for each batch instead of for each line: a
    charge per turn, a hundred turns a second, each had paid both. Lines land in the order given,
    and `append` returns once its line is on disk.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Path, bytes, asyncio.Future]] = []
        self._draining: asyncio.Future | None = None

    async def append(self, path: Path, line: bytes) -> None:
        done = asyncio.get_running_loop().create_future()
        self._pending.append((path, line, done))
        if self._draining is None:
            self._draining = asyncio.ensure_future(self._drain())
        await done

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                outcome: BaseException | None = None
                try:
                    await asyncio.to_thread(_append_lines, [(path, line) for path, line, _ in batch])
                except BaseException as exc:  # cancelled at shutdown too: nobody is left waiting
                    outcome = exc
                for _, _, done in batch:
                    if done.done():
                        continue
                    if outcome is None:
                        done.set_result(None)
                    elif isinstance(outcome, Exception):
                        done.set_exception(outcome)
                    else:
                        done.cancel()
                if outcome is not None and not isinstance(outcome, Exception):
                    raise outcome
        finally:
            self._draining = None


def _append_lines(lines: list[tuple[Path, bytes]]) -> None:
    by_file: dict[Path, list[bytes]] = {}
    for path, line in lines:
        by_file.setdefault(path, []).append(line)
    for path, chunks in by_file.items():
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, flags, 0o600)
        try:
            write_synced(fd, b"".join(chunks))
        finally:
            os.close(fd)


# KEYS: the month's hash, its spent counter, the owners set. ARGV: charge id, charge JSON, its cost
# ("" when unknown), the owner. The counter moves by the difference from the charge it replaces.
_PUT = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
local before = 0
if old then
  local c = cjson.decode(old)['cost']
  if type(c) == 'number' then before = c end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local now = 0
if ARGV[3] ~= '' then now = tonumber(ARGV[3]) end
redis.call('INCRBYFLOAT', KEYS[2], string.format('%.12f', now - before))
redis.call('SADD', KEYS[3], ARGV[4])
return 1
"""


class RedisLedger:
    """The ledger in the Redis every server shares (keys under the store's prefix). `reachable` is
    the store's: Redis connection failures become StoreUnavailable, as for conversations."""

    def __init__(self, redis, prefix: str,  # redis.asyncio.Redis
                 reachable: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
        self.redis = redis
        self.prefix = prefix
        self.reachable = reachable
        self._put = redis.register_script(_PUT)

    def _month_key(self, owner: str, month: str) -> str:
        return f"{self.prefix}ledger:{owner}:{month}"

    async def put(self, owner: str, charge: dict) -> None:
        month = charge["id"].split(".", 1)[0]
        cost = "" if charge.get("cost") is None else repr(float(charge["cost"]))
        with self.reachable():
            await self._put(keys=[self._month_key(owner, month), self._month_key(owner, month) + ":spent",
                                  f"{self.prefix}ledger:owners"],
                            args=[charge["id"], orjson.dumps(charge), cost, owner])

    async def get(self, owner: str, charge_id: str) -> dict | None:
        with self.reachable():
            raw = await self.redis.hget(self._month_key(owner, charge_id.split(".", 1)[0]), charge_id)
        return orjson.loads(raw) if raw else None

    async def month(self, owner: str, month: str) -> list[dict]:
        with self.reachable():
            return [orjson.loads(raw) for raw in await self.redis.hvals(self._month_key(owner, month))]

    async def month_spent(self, owner: str, month: str) -> float:
        with self.reachable():
            raw = await self.redis.get(self._month_key(owner, month) + ":spent")
        return round(float(raw), 10) if raw else 0.0

    async def months(self, owner: str) -> list[str]:
        start = len(f"{self.prefix}ledger:{owner}:")
        pattern = f"{self.prefix}ledger:{owner}:[0-9][0-9][0-9][0-9]-[0-9][0-9]"
        with self.reachable():
            keys = [k async for k in self.redis.scan_iter(match=pattern)]
        return sorted(k.decode()[start:] for k in keys)

    async def owners(self) -> list[str]:
        with self.reachable():
            return sorted(m.decode() for m in await self.redis.smembers(f"{self.prefix}ledger:owners"))

    async def wait_for_gateway(self, owner: str, charge_id: str) -> None:
        with self.reachable():
            await self.redis.sadd(f"{self.prefix}ledger:waiting", f"{owner} {charge_id}")

    async def settled(self, owner: str, charge_id: str) -> None:
        with self.reachable():
            await self.redis.srem(f"{self.prefix}ledger:waiting", f"{owner} {charge_id}")

    async def waiting(self) -> list[tuple[str, str]]:
        with self.reachable():
            members = await self.redis.smembers(f"{self.prefix}ledger:waiting")
        return [tuple(m.decode().split(" ", 1)) for m in members]

    async def read_setting(self, name: str) -> dict:
        with self.reachable():
            raw = await self.redis.get(f"{self.prefix}kv:costs:{name}")
        value = orjson.loads(raw) if raw else {}
        return value if isinstance(value, dict) else {}

    async def write_setting(self, name: str, value: dict) -> None:
        with self.reachable():
            await self.redis.set(f"{self.prefix}kv:costs:{name}", orjson.dumps(value))

    async def close(self) -> None:
        return None


SETTINGS = ("prices", "budgets", "waiting")


async def copy_ledger(source: Ledger, target: Ledger) -> int:
    """Every charge and setting of `source` into `target` (`server.py migrate`); running it again
    changes nothing. Returns the charges copied."""
    copied = 0
    for owner in await source.owners():
        for month in await source.months(owner):
            for charge in await source.month(owner, month):
                if await target.get(owner, charge["id"]) != charge:
                    await target.put(owner, charge)
                copied += 1
    for name in SETTINGS:
        value = await source.read_setting(name)
        if value:
            await target.write_setting(name, value)
    return copied
