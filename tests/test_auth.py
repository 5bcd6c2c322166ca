"""Several people on one server: accounts, sessions, throttled logins, the trusted-proxy header, the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import secrets
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import httpx
import orjson
import pytest
import redis as sync_redis
from argon2 import PasswordHasher
from fastapi import Depends
from pydantic import ValidationError

from chatserver.accounts import auth
from chatserver.accounts.auth import (
    FAILURES_PER_ADDRESS,
    FAILURES_PER_USER,
    LOCAL_OWNER,
    NAME_CEILING,
    WINDOW_SECONDS,
    Accounts,
    User,
    UserFile,
    current_user,
)
from chatserver.app import create_app, make_account_store
from chatserver.config import ROOT, Settings
from gateway_sim.simulator import Script, steps

# Cheap hashes keep the tests fast; the server's default is argon2-cffi's RFC 9106 profile.
FAST = PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1)
PUBLIC = {"/api/login", "/api/auth/login", "/api/auth/me", "/healthz", "/", "/api/shared/{share_id}"}
A_PASSWORD = "alice's long secret"
B_PASSWORD = "bob's other secret"


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


class CountingHasher(PasswordHasher):
    """FAST, counting the argon2 verifications it runs."""

    def __init__(self) -> None:
        super().__init__(time_cost=1, memory_cost=1024, parallelism=1)
        self.verifications = 0

    def verify(self, hash, password):  # noqa: A002  (argon2's own parameter name)
        self.verifications += 1
        return super().verify(hash, password)


def snapshot(data_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(data_dir)): p.read_bytes() for p in sorted(data_dir.rglob("*")) if p.is_file()}


class Server:
    """The real app under some settings, with a clock and counting hasher the test controls."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.clock = Clock()
        self.hasher = CountingHasher()
        self.app = create_app(settings)

    async def __aenter__(self) -> "Server":
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        self.restart_accounts()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._lifespan.__aexit__(*exc)

    def client(self, peer: str = "192.0.2.10", base_url: str = "http://127.0.0.1") -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=self.app, client=(peer, 50000))
        return httpx.AsyncClient(transport=transport, base_url=base_url, timeout=30)

    def restart_accounts(self) -> None:
        """What a server restart does to accounts and sessions: read them back from where STORE keeps them."""
        store = make_account_store(self.settings, self.app.state.chat.store)
        self.accounts = self.app.state.accounts = Accounts(self.settings, store, clock=self.clock, hasher=self.hasher)


_databases = itertools.count(1)


def store_options(request) -> dict:
    """Settings for the store a test is parametrized with: files, or a Redis database emptied for it."""
    if request.param == "files":
        return {}
    url = f"{request.getfixturevalue('redis_server').url[:-2]}/{next(_databases) % 16}"
    with contextlib.closing(sync_redis.Redis.from_url(url)) as r:
        r.flushdb()  # this module's tests run one after another on this Redis; an earlier one may have used it
    return {"store": "redis", "redis_url": url}


@pytest.fixture
async def file_server(tmp_path, sim):
    """A server keeping accounts in DATA_DIR (STORE=files), whose files the test may read."""
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        upstream_timeout=5, auth="password", trusted_proxies=["10.0.0.1"])
    users = UserFile(settings.data_dir)
    users.add("alice", FAST.hash(A_PASSWORD), admin=True, now=0)
    users.add("bob", FAST.hash(B_PASSWORD), admin=False, now=0)
    async with Server(settings) as srv:
        yield srv


@pytest.fixture(params=["files", "redis"])
async def server(request, tmp_path, sim):
    """The same server on either store: what a person sees of accounts does not depend on STORE."""
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        upstream_timeout=5, auth="password", trusted_proxies=["10.0.0.1"], **store_options(request))
    async with Server(settings) as srv:
        await srv.accounts.store.add_user("alice", FAST.hash(A_PASSWORD), admin=True, now=0)
        await srv.accounts.store.add_user("bob", FAST.hash(B_PASSWORD), admin=False, now=0)
        yield srv


async def log_in(client: httpx.AsyncClient, username: str, password: str) -> httpx.Response:
    return await client.post("/api/auth/login", json={"username": username, "password": password})


def guarded_requests(app) -> list[tuple[str, str]]:
    """Every route the app serves but the public ones, from its OpenAPI schema, path parameters filled in."""
    out = []
    for path, operations in app.openapi()["paths"].items():
        if path in PUBLIC:
            continue
        concrete = re.sub(r"\{[^}]+\}", "abcdefgh12345", path)
        out += [(method.upper(), concrete) for method in operations]
    return out + [("GET", "/openapi.json"), ("GET", "/docs")]


# --- 401 without a session ----------------------------------------------------------------------

async def test_every_api_route_answers_401_without_a_valid_session(server, sim):
    routes = guarded_requests(server.app)
    assert ("POST", "/api/conversations/abcdefgh12345/messages") in routes  # the enumeration sees routes
    assert ("POST", "/api/auth/logout") in routes  # and those of included routers
    async with server.client() as client:
        forged = {"chat_session": secrets.token_urlsafe(32)}
        for cookies in ({}, forged, {"chat_token": "x"}):
            client.cookies.clear()
            client.cookies.update(cookies)
            for method, path in routes:
                response = await client.request(method, path, json={} if method != "GET" else None)
                assert response.status_code == 401, (method, path, cookies, response.status_code)
                assert response.json()["detail"], (method, path)
        me = await client.get("/api/auth/me")
        assert me.status_code == 401 and me.json()["login"] == "password"

        client.cookies.clear()
        assert (await log_in(client, "alice", A_PASSWORD)).status_code == 204
        for method, path in sorted(routes, key=lambda r: r[1] == "/api/auth/logout"):  # logout last
            if path == "/api/events":  # never ends, and ASGI transport waits for the end: test_person_events
                continue
            response = await client.request(method, path, json={} if method != "GET" else None)
            assert response.status_code != 401, (method, path)
    assert sim.requests == []


async def test_nothing_changes_on_a_401(server, sim):
    before = snapshot(server.settings.data_dir)
    async with server.client() as client:
        for method, path in guarded_requests(server.app):
            await client.request(method, path, json={"content": "x", "text": "x", "id": "a/b"})
    assert snapshot(server.settings.data_dir) == before
    assert sim.requests == []


# --- Logging in and out -------------------------------------------------------------------------

async def test_login_sets_an_httponly_lax_cookie_and_me_names_the_user(file_server):
    async with file_server.client() as client:
        response = await log_in(client, "Alice", A_PASSWORD)  # names are case-insensitive
        assert response.status_code == 204
        attributes = [a.strip().lower() for a in response.headers["set-cookie"].split(";")]
        assert attributes[0].startswith("chat_session=")
        assert {"httponly", "samesite=lax", "path=/"} <= set(attributes)
        assert "secure" not in attributes  # plain http
        assert (await client.get("/api/auth/me")).json() == {"username": "alice", "admin": True}
        session_id = client.cookies["chat_session"]
        assert len(session_id) >= 40
    stored = (file_server.settings.data_dir / "sessions.json").read_text()
    assert session_id not in stored  # only its hash is kept
    async with file_server.client() as client:
        await log_in(client, "bob", B_PASSWORD)
        assert (await client.get("/api/auth/me")).json() == {"username": "bob", "admin": False}


async def test_the_cookie_is_secure_over_https_and_behind_a_trusted_https_proxy(server):
    async with server.client(base_url="https://127.0.0.1") as client:
        assert "secure" in (await log_in(client, "alice", A_PASSWORD)).headers["set-cookie"].lower()
    proto = {"x-forwarded-proto": "https"}
    async with server.client(peer="10.0.0.1") as client:
        response = await client.post("/api/auth/login", json={"username": "alice", "password": A_PASSWORD},
                                     headers=proto)
        assert "secure" in response.headers["set-cookie"].lower()
    async with server.client(peer="10.0.0.9") as client:  # anyone may send the header; it is not believed
        response = await client.post("/api/auth/login", json={"username": "alice", "password": A_PASSWORD},
                                     headers=proto)
        assert "secure" not in response.headers["set-cookie"].lower()


async def test_a_logged_out_cookie_is_401(server):
    async with server.client() as client:
        await log_in(client, "alice", A_PASSWORD)
        session_id = client.cookies["chat_session"]
        assert (await client.get("/api/conversations")).status_code == 200
        out = await client.post("/api/auth/logout")
        assert out.status_code == 204
        assert 'chat_session=""' in out.headers["set-cookie"] or "max-age=0" in out.headers["set-cookie"].lower()
        client.cookies.clear()
        client.cookies["chat_session"] = session_id  # the old cookie, kept by someone
        assert (await client.get("/api/conversations")).status_code == 401
    server.restart_accounts()
    async with server.client() as client:
        client.cookies["chat_session"] = session_id
        assert (await client.get("/api/conversations")).status_code == 401


async def test_sessions_expire_after_session_hours_idle_and_slide_while_used(server):
    idle = server.settings.session_hours * 3600
    async with server.client() as client:
        await log_in(client, "alice", A_PASSWORD)
        for _ in range(3):  # used every 0.9 idle periods: stays alive well past one period
            server.clock.now += idle * 0.9
            assert (await client.get("/api/conversations")).status_code == 200
        server.clock.now += idle + 1
        assert (await client.get("/api/conversations")).status_code == 401
        assert (await client.get("/api/auth/me")).status_code == 401


async def test_a_restart_keeps_people_logged_in_and_last_seen_is_written_at_most_once_a_minute(file_server):
    path = file_server.settings.data_dir / "sessions.json"
    async with file_server.client() as client:
        await log_in(client, "alice", A_PASSWORD)
        written = path.read_bytes()
        file_server.clock.now += 30
        assert (await client.get("/api/conversations")).status_code == 200
        assert path.read_bytes() == written  # a request within the minute writes nothing
        file_server.clock.now += 31
        assert (await client.get("/api/conversations")).status_code == 200
        [session] = orjson.loads(path.read_bytes())["sessions"].values()
        assert session["last_seen"] == file_server.clock.now and session["username"] == "alice"

        file_server.restart_accounts()
        assert (await client.get("/api/auth/me")).json()["username"] == "alice"


async def test_removing_a_user_or_changing_the_password_ends_their_sessions(server):
    users = server.accounts.store
    async with server.client() as a, server.client() as b, server.client() as c:
        await log_in(a, "alice", A_PASSWORD)
        await log_in(b, "bob", B_PASSWORD)
        await log_in(c, "alice", A_PASSWORD)
        await users.set_password("alice", FAST.hash("a brand new secret"))
        assert (await a.get("/api/conversations")).status_code == 401
        assert (await c.get("/api/conversations")).status_code == 401
        assert (await b.get("/api/conversations")).status_code == 200
        await users.remove_user("bob")
        assert (await b.get("/api/conversations")).status_code == 401
        assert (await log_in(b, "bob", B_PASSWORD)).status_code == 401


# --- Equal answers and throttling ---------------------------------------------------------------

async def test_unknown_user_and_wrong_password_read_the_same_and_cost_one_verification_each(server):
    async with server.client() as client:
        answers = []
        for username, password in [("alice", "wrong password"), ("nobody", "wrong password"),
                                   ("not a valid name!", "wrong password"), ("bob", A_PASSWORD)]:
            before = server.hasher.verifications
            response = await log_in(client, username, password)
            assert server.hasher.verifications - before == 1, username
            answers.append((response.status_code, response.json(), "set-cookie" in response.headers))
        assert answers == [(401, {"detail": "wrong user name or password"}, False)] * 4


async def test_the_dummy_hash_for_unknown_names_is_made_at_start_up_not_on_the_first_unknown_login(
        tmp_path, sim, monkeypatch):
    """The first unknown-name login used to hash as well as verify: slower than a known name's, so telling."""
    hashed = []

    class Hasher(PasswordHasher):
        def hash(self, password, *, salt=None):
            hashed.append(1)
            return FAST.hash(password)

    monkeypatch.setattr(auth, "PasswordHasher", Hasher)
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        upstream_timeout=5, auth="password")
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        assert len(hashed) == 1  # before any request
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            assert (await log_in(client, "nobody", "some password")).status_code == 401
        assert len(hashed) == 1


async def test_failures_are_logged_with_name_and_address_never_the_password(server, caplog):
    caplog.set_level(logging.WARNING, logger="chat.auth")
    async with server.client(peer="198.51.100.7") as client:
        await log_in(client, "alice", "hunter2-but-longer")
    [record] = [r for r in caplog.records if r.name == "chat.auth"]
    assert "alice" in record.getMessage() and "198.51.100.7" in record.getMessage()
    assert "hunter2" not in caplog.text


async def test_five_wrong_passwords_lock_the_user_name_at_that_address_only(server):
    async with server.client() as client:
        for i in range(FAILURES_PER_USER):
            assert (await log_in(client, "alice", f"wrong guess {i}")).status_code == 401
        locked = await log_in(client, "alice", A_PASSWORD)
        assert locked.status_code == 429
        assert 0 < int(locked.headers["retry-after"]) <= WINDOW_SECONDS
        assert locked.json()["detail"]
        assert (await log_in(client, "nobody", "wrong guess 0")).status_code == 401  # other names go on
        async with server.client(peer="203.0.113.5") as elsewhere:  # a guesser cannot lock the owner out
            assert (await log_in(elsewhere, "alice", A_PASSWORD)).status_code == 204
        server.clock.now += WINDOW_SECONDS
        assert (await log_in(client, "alice", A_PASSWORD)).status_code == 204


async def test_fifty_concurrent_guesses_get_at_most_five_verifications_and_the_rest_429(server):
    """Every guess used to pass the check before the first of them failed: 60 were all verified."""
    async with server.client() as client:
        guesses = [log_in(client, "alice", f"concurrent guess {i}") for i in range(50)]
        answers = await asyncio.gather(*guesses, log_in(client, "alice", A_PASSWORD))
    statuses = [a.status_code for a in answers]
    assert server.hasher.verifications <= FAILURES_PER_USER
    assert statuses.count(429) >= len(answers) - FAILURES_PER_USER
    assert statuses.count(401) + statuses.count(204) == server.hasher.verifications


async def test_past_the_ceiling_guesses_at_one_name_from_many_addresses_are_paced_not_refused(server, monkeypatch):
    monkeypatch.setattr(auth, "NAME_PACE_SECONDS", 0.4)
    for a in range(NAME_CEILING // FAILURES_PER_USER):
        async with server.client(peer=f"198.51.100.{a}") as guesser:
            for i in range(FAILURES_PER_USER):
                assert (await log_in(guesser, "alice", f"guess {a}-{i}")).status_code == 401
    started = time.monotonic()
    clients = [server.client(peer=f"203.0.113.{n}") for n in range(3)]
    answers = await asyncio.gather(log_in(clients[0], "alice", "one more guess"),
                                   log_in(clients[1], "alice", "and another"), log_in(clients[2], "alice", A_PASSWORD))
    took = time.monotonic() - started
    for c in clients:
        await c.aclose()
    assert [a.status_code for a in answers] == [401, 401, 204]
    assert took >= 2 * 0.4  # the three went one pace apart


async def test_an_unknown_name_is_throttled_like_a_known_one(server):
    async with server.client() as client:
        for name in ("alice", "nobody"):
            statuses = [(await log_in(client, name, f"guess {i}")).status_code for i in range(FAILURES_PER_USER + 1)]
            assert statuses == [401] * FAILURES_PER_USER + [429], name


async def test_one_address_guessing_many_names_is_locked_out(server):
    async with server.client(peer="198.51.100.7") as attacker, server.client(peer="203.0.113.5") as other:
        for i in range(FAILURES_PER_ADDRESS):
            assert (await log_in(attacker, f"user{i}", "guess")).status_code == 401
        assert (await log_in(attacker, "bob", B_PASSWORD)).status_code == 429
        assert (await log_in(other, "bob", B_PASSWORD)).status_code == 204


async def test_repeating_the_same_wrong_password_counts_once(server):
    async with server.client() as client:
        for _ in range(FAILURES_PER_USER * 2):
            assert (await log_in(client, "alice", "stale saved password")).status_code == 401
        assert (await log_in(client, "alice", A_PASSWORD)).status_code == 204


async def test_behind_a_trusted_proxy_the_forwarded_address_is_throttled_not_the_proxy(server):
    async with server.client(peer="10.0.0.1") as proxy:
        for i in range(FAILURES_PER_ADDRESS):
            await proxy.post("/api/auth/login", json={"username": f"user{i}", "password": "guess"},
                             headers={"x-forwarded-for": "198.51.100.7"})
        blocked = await proxy.post("/api/auth/login", json={"username": "bob", "password": B_PASSWORD},
                                   headers={"x-forwarded-for": "198.51.100.7"})
        assert blocked.status_code == 429
        fine = await proxy.post("/api/auth/login", json={"username": "bob", "password": B_PASSWORD},
                                headers={"x-forwarded-for": "203.0.113.5"})
        assert fine.status_code == 204


async def test_login_from_a_foreign_origin_is_refused(server):
    async with server.client() as client:
        response = await client.post("/api/auth/login", json={"username": "alice", "password": A_PASSWORD},
                                     headers={"origin": "http://evil.example"})
        assert response.status_code == 403 and "chat_session" not in client.cookies


# --- Owners -------------------------------------------------------------------------------------

def test_the_first_admin_inherits_the_single_person_data_and_owners_are_never_reused(tmp_path):
    users = UserFile(tmp_path)
    first = users.add("carol", None, admin=False, now=0)
    admin = users.add("alice", None, admin=True, now=0)
    second_admin = users.add("root", None, admin=True, now=0)
    assert admin["owner"] == LOCAL_OWNER
    assert first["owner"] != LOCAL_OWNER and second_admin["owner"] != LOCAL_OWNER
    users.remove("carol")
    again = users.add("Carol", None, admin=False, now=0)
    assert again["owner"] not in {first["owner"], LOCAL_OWNER, second_admin["owner"]}
    with pytest.raises(ValueError, match="already"):
        users.add("ALICE", None, admin=False, now=0)
    for bad in ("", "a b", "x" * 65, "../etc", "名前"):
        with pytest.raises(ValueError, match="user names"):
            users.add(bad, None, admin=False, now=0)
    with pytest.raises(ValueError, match="reserved"):  # AUTH=none's person; the page tells them apart by it
        users.add("Local", None, admin=True, now=0)


async def test_routes_learn_their_user_and_owner_from_one_dependency(tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        upstream_timeout=5, auth="password")
    users = UserFile(settings.data_dir)
    users.add("alice", FAST.hash(A_PASSWORD), admin=True, now=0)
    users.add("bob", FAST.hash(B_PASSWORD), admin=False, now=0)
    server = Server(settings)

    async def whoami(user: Annotated[User, Depends(current_user)]) -> dict:
        return {"name": user.name, "admin": user.admin, "owner": user.owner}

    server.app.add_api_route("/api/whoami", whoami)
    async with server, server.client() as client:
        assert (await client.get("/api/whoami")).status_code == 401
        await log_in(client, "alice", A_PASSWORD)
        assert (await client.get("/api/whoami")).json() == {"name": "alice", "admin": True, "owner": LOCAL_OWNER}
        await log_in(client, "bob", B_PASSWORD)
        bob = (await client.get("/api/whoami")).json()
        assert bob["name"] == "bob" and not bob["admin"] and bob["owner"] == users.find("bob")["owner"]


# --- AUTH=header --------------------------------------------------------------------------------

@pytest.fixture(params=["files", "redis"])
async def proxied(request, tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        upstream_timeout=5, auth="header", trusted_proxies=["10.0.0.1", "10.1.0.0/16"],
                        admin_users="Root", **store_options(request))
    async with Server(settings) as srv:
        yield srv


async def test_header_mode_believes_the_header_only_from_a_trusted_proxy(proxied, sim):
    as_alice = {"x-forwarded-user": "alice"}
    for peer in ("10.0.0.1", "10.1.2.3"):
        async with proxied.client(peer=peer) as client:
            assert (await client.get("/api/auth/me", headers=as_alice)).json() == {"username": "alice", "admin": False}
            assert (await client.get("/api/conversations", headers=as_alice)).status_code == 200
            assert (await client.get("/api/conversations")).status_code == 401  # no header, no one
            assert (await client.get("/api/conversations", headers={"x-forwarded-user": "a b"})).status_code == 401
    before = snapshot(proxied.settings.data_dir)
    for peer in ("10.0.0.9", "127.0.0.1", "10.2.0.1"):
        async with proxied.client(peer=peer) as client:
            for method, path in guarded_requests(proxied.app):
                response = await client.request(method, path, headers={"x-forwarded-user": "root"},
                                                json={} if method != "GET" else None)
                assert response.status_code == 401, (peer, method, path)
            assert (await client.get("/api/auth/me", headers=as_alice)).status_code == 401
    assert snapshot(proxied.settings.data_dir) == before
    assert sim.requests == []


async def test_header_users_are_created_on_first_sight_and_admin_users_are_admins(proxied):
    async with proxied.client(peer="10.0.0.1") as client:
        assert (await client.get("/api/auth/me", headers={"x-forwarded-user": "root"})).json() == \
            {"username": "root", "admin": True}
        await client.get("/api/auth/me", headers={"x-forwarded-user": "dave@example.com"})
    users = proxied.accounts.store  # users.json, or Redis: wherever STORE keeps accounts
    assert (await users.find_user("ROOT"))["owner"] == LOCAL_OWNER
    assert (await users.find_user("dave@example.com"))["password_hash"] is None
    assert [u["name"] for u in await users.users()] == ["root", "dave@example.com"]
    async with proxied.client(peer="10.0.0.1") as client:  # no password login in header mode
        response = await log_in(client, "dave@example.com", "anything at all")
        assert response.status_code == 400


# --- AUTH=none ----------------------------------------------------------------------------------

async def test_without_accounts_the_local_owner_is_an_admin(client):
    assert (await client.get("/api/auth/me")).json() == {"username": "local", "admin": True}
    assert (await client.get("/api/conversations")).status_code == 200


# --- ACCESS_TOKEN (AUTH=none) -------------------------------------------------------------------

TOKEN = "tok-" + secrets.token_urlsafe(24)


@pytest.fixture(params=["files", "redis"])
async def tokened(request, tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        upstream_timeout=5, access_token=TOKEN, **store_options(request))
    async with Server(settings) as srv:
        yield srv


async def test_token_logins_get_random_sessions_that_expire_and_can_be_revoked(tokened):
    async with tokened.client() as first, tokened.client() as second:
        assert (await first.post("/api/login", json={"token": TOKEN})).status_code == 204
        assert (await second.post("/api/login", json={"token": TOKEN})).status_code == 204
        assert first.cookies["chat_token"] != second.cookies["chat_token"]
        assert (await first.get("/api/auth/me")).json() == {"username": "local", "admin": True}
        kept = first.cookies["chat_token"]
        assert (await first.post("/api/auth/logout")).status_code == 204
        first.cookies.clear()
        first.cookies["chat_token"] = kept
        assert (await first.get("/api/conversations")).status_code == 401
        assert (await second.get("/api/conversations")).status_code == 200
        tokened.clock.now += tokened.settings.session_hours * 3600 + 1
        assert (await second.get("/api/conversations")).status_code == 401
        assert (await second.get("/api/auth/me")).json()["login"] == "token"
    async with tokened.client(base_url="https://127.0.0.1") as client:
        assert "secure" in (await client.post("/api/login", json={"token": TOKEN})).headers["set-cookie"].lower()


async def test_token_guesses_are_throttled_and_logged(tokened, caplog):
    caplog.set_level(logging.WARNING, logger="chat.auth")
    async with tokened.client(peer="198.51.100.7") as attacker, tokened.client(peer="203.0.113.5") as owner:
        for i in range(FAILURES_PER_ADDRESS // 2):
            assert (await attacker.post("/api/login", json={"token": f"guess-{i}"})).status_code == 401
            response = await attacker.get("/api/conversations", headers={"authorization": f"Bearer bearer-{i}"})
            assert response.status_code == 401
        for request in (attacker.post("/api/login", json={"token": TOKEN}),
                        attacker.get("/api/conversations", headers={"authorization": f"Bearer {TOKEN}"})):
            response = await request
            assert response.status_code == 429 and int(response.headers["retry-after"]) > 0
        assert (await owner.get("/api/conversations", headers={"authorization": f"Bearer {TOKEN}"})).status_code == 200
    assert "198.51.100.7" in caplog.text and "guess-3" not in caplog.text


@pytest.mark.parametrize("weak", ["short-token", "a" * 40, "abababababababababababab", "1234512345123451234512345"])
def test_a_weak_token_is_refused_off_loopback(weak, tmp_path):
    with pytest.raises(ValidationError, match="ACCESS_TOKEN"):
        Settings(_env_file=None, host="0.0.0.0", access_token=weak, data_dir=tmp_path)
    assert Settings(_env_file=None, host="127.0.0.1", access_token=weak, data_dir=tmp_path).access_token == weak


def test_accounts_need_no_token_off_loopback_but_header_mode_needs_its_proxies(tmp_path):
    assert Settings(_env_file=None, host="0.0.0.0", auth="password", data_dir=tmp_path).access_token is None
    with pytest.raises(ValidationError, match="TRUSTED_PROXIES"):
        Settings(_env_file=None, auth="header", data_dir=tmp_path)
    with pytest.raises(ValidationError, match="TRUSTED_PROXIES"):
        Settings(_env_file=None, auth="header", trusted_proxies="proxy.lan", data_dir=tmp_path)


# --- The command line ---------------------------------------------------------------------------

def run_cli(data_dir: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ACCESS_TOKEN", "AUTH", "HOST")}
    env.update(DATA_DIR=str(data_dir), AUTH="password")
    return subprocess.run([sys.executable, str(ROOT / "server.py"), "user", *args], input=stdin, env=env,
                          cwd=data_dir.parent, capture_output=True, text=True, timeout=60)


async def test_the_user_command_manages_accounts_a_running_server_uses(tmp_path, sim):
    data = tmp_path / "data"
    data.mkdir()
    added = run_cli(data, "add", "alice", "--admin", stdin="correct horse battery\n")
    assert added.returncode == 0, added.stderr
    assert run_cli(data, "add", "bob", stdin="bob's password here\n").returncode == 0
    listed = run_cli(data, "list")
    assert listed.returncode == 0
    assert [line.split()[:2] for line in listed.stdout.splitlines()] == [["alice", "admin"], ["bob", "created"]]
    stored = (data / "users.json").read_text()
    assert "correct horse" not in stored and "$argon2id$" in stored

    for args, stdin, message in [(("add", "ALICE"), "another password\n", "already"),
                                 (("add", "carol"), "short\n", "at least"),
                                 (("add", "bad name"), "long enough pw\n", "user names"),
                                 (("passwd", "nobody"), "long enough pw\n", "no user"),
                                 (("remove", "nobody"), "", "no user")]:
        refused = run_cli(data, *args, stdin=stdin)
        assert refused.returncode == 1 and message in refused.stderr, (args, refused.stderr)
    assert run_cli(data, "frobnicate").returncode == 2

    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=data, upstream_timeout=5,
                        auth="password")
    async with Server(settings) as server, server.client() as client:
        server.accounts.hasher = PasswordHasher()  # the CLI's hashes use the default profile
        assert (await log_in(client, "alice", "correct horse battery")).status_code == 204
        assert (await client.get("/api/auth/me")).json() == {"username": "alice", "admin": True}

        assert run_cli(data, "passwd", "alice", stdin="a newer password\n").returncode == 0
        assert (await client.get("/api/auth/me")).status_code == 401
        assert (await log_in(client, "alice", "a newer password")).status_code == 204
        assert run_cli(data, "remove", "alice", "--yes").returncode == 0
        assert (await client.get("/api/auth/me")).status_code == 401
    assert run_cli(data, "list").stdout.split()[0] == "bob"


async def a_person_with_data(client, sim, password: str, word: str) -> dict:
    """Log in and leave something everywhere a person's data lives; the conversation made."""
    conv = (await client.post("/api/conversations", json={})).json()
    await client.patch(f"/api/conversations/{conv['id']}", json={"settings": {"web_search": False, "web_fetch": False}})
    sim.enqueue(Script(steps=[steps.Text(f"An answer about {word}.")]))
    assert (await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": f"tell me of {word}"})).status_code == 200  # noqa: E501
    uploaded = await client.post(f"/api/conversations/{conv['id']}/attachments",
                                 files={"file": ("notes.txt", f"{word} notes".encode(), "text/plain")})
    assert uploaded.status_code == 201, uploaded.text
    assert (await client.post("/api/library", files={"file": ("lib.txt", b"library text", "text/plain")})).status_code == 201
    assert (await client.put("/api/memory", json={"text": f"- likes {word}\n"})).status_code == 200
    preset = await client.post("/api/presets", json={"name": f"{word}-helper", "text": "Be brief.", "tools": []})
    assert preset.status_code == 201, preset.text
    assert (await client.get("/api/search", params={"q": word})).json()
    return conv


def index_rows(data: Path, owner: str) -> int:
    with contextlib.closing(sqlite3.connect(data / "index" / "search.sqlite3")) as db:
        return sum(db.execute(f"SELECT count(*) FROM {table} WHERE owner = ?", (owner,)).fetchone()[0]
                   for table in ("convs", "docs"))


async def test_user_remove_removes_the_persons_data_once_confirmed(file_server, sim, tmp_path):
    # It used to drop the account only: conversations, files, memory and presets stayed on disk.
    data = file_server.settings.data_dir
    owners = {u["name"]: u["owner"] for u in UserFile(data).load()["users"]}
    async with file_server.client() as alice, file_server.client() as bob:
        assert (await log_in(alice, "alice", A_PASSWORD)).status_code == 204
        assert (await log_in(bob, "bob", B_PASSWORD)).status_code == 204
        kept = await a_person_with_data(alice, sim, A_PASSWORD, "zanzibar")
        gone = await a_person_with_data(bob, sim, B_PASSWORD, "madagascar")
        bobs_files = [data / "conversations" / f"{gone['id']}.json", data / "attachments" / gone["id"],
                      data / "attachments" / "library" / owners["bob"], data / "users" / owners["bob"]]
        assert all(p.exists() for p in bobs_files) and index_rows(data, owners["bob"]) > 0

        unconfirmed = run_cli(data, "remove", "bob")

        assert unconfirmed.returncode == 1 and "nothing removed" in unconfirmed.stderr
        assert all(p.exists() for p in bobs_files) and UserFile(data).find("bob") is not None

        removed = run_cli(data, "remove", "bob", "--yes")

        assert removed.returncode == 0, removed.stderr
        assert "removed bob and their data: 1 conversations" in removed.stdout
        assert not any(p.exists() for p in bobs_files) and index_rows(data, owners["bob"]) == 0
        assert UserFile(data).find("bob") is None
        assert (await bob.get("/api/auth/me")).status_code == 401
        # Everyone else's data is as it was.
        assert (await alice.get(f"/api/conversations/{kept['id']}")).status_code == 200
        assert (data / "attachments" / kept["id"]).exists() and (data / "memory.md").read_text() == "- likes zanzibar\n"
        assert index_rows(data, owners["alice"]) > 0
