"""Accounts on Redis (STORE=redis): several servers, each with a DATA_DIR of its own, share users,
sessions and one count of wrong guesses, and nothing about accounts is written to disk.

Before, users and sessions lived in each DATA_DIR and the throttle in each process's memory: B did
not know A's sessions (and its next login erased them), and N servers allowed N times the guesses.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest
import redis as sync_redis

from chatserver.accounts import auth
from chatserver.accounts.auth import FAILURES_PER_USER, SESSION_COOKIE, Accounts, _digest
from chatserver.accounts.files import FileAccountStore, UserFile
from chatserver.accounts.store import AccountsDump, AccountStore, BadAccount, Throttled
from chatserver.app import make_account_store, make_store
from chatserver.config import ROOT, Settings
from redis_support import RedisServer, unique_prefix
from support import LiveServer
from test_auth import A_PASSWORD, FAST, Server

_databases = itertools.count(1)
PASSWORD = "a shared long secret"


def redis_url(redis_server) -> str:
    """A database of this module's redis-server, emptied for the test (the tests run one at a time on it)."""
    url = f"redis://127.0.0.1:{redis_server.port}/{1 + next(_databases) % 15}"  # 0: the migration's prefixes
    with sync_redis.Redis.from_url(url) as client:
        client.flushdb()
    return url


def add_users(url: str, *users: tuple[str, str, bool]) -> dict[str, dict]:
    """Add users (name, password, admin) to the accounts of STORE=redis at `url`, with cheap hashes."""
    settings = Settings(_env_file=None, store="redis", redis_url=url)

    async def add() -> dict[str, dict]:
        store = make_store(settings)
        accounts = make_account_store(settings, store)
        try:
            return {name: await accounts.add_user(name, FAST.hash(password), admin, time.time())
                    for name, password, admin in users}
        finally:
            await store.close()

    return asyncio.run(add())


def user_command(url: str, data_dir: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ACCESS_TOKEN", "HOST")}
    env.update(DATA_DIR=str(data_dir), AUTH="password", STORE="redis", REDIS_URL=url)
    return subprocess.run([sys.executable, str(ROOT / "server.py"), "user", *args], input=stdin, env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def start(tmp_path: Path, name: str, url: str, sim, **extra: str) -> LiveServer:
    data_dir = tmp_path / name / "data"
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    return LiveServer(data_dir, {"GATEWAY_BASE_URL": sim.base_url, "STORE": "redis", "REDIS_URL": url,
                                 "AUTH": "password", **extra})


def log_in(server: LiveServer, name: str, password: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}/api/auth/login", json={"username": name, "password": password}, timeout=30)


def me(server: LiveServer, session: str) -> int:
    return httpx.get(f"{server.base_url}/api/auth/me", cookies={SESSION_COOKIE: session}, timeout=10).status_code


def no_accounts_on_disk(*servers: LiveServer) -> None:
    for server in servers:
        assert not any(server.data_dir.rglob("users.json")), server.data_dir
        assert not any(server.data_dir.rglob("sessions.json")), server.data_dir


@pytest.fixture
def shared(tmp_path, sim, redis_server):
    url = redis_url(redis_server)
    servers = [start(tmp_path, "a", url, sim), start(tmp_path, "b", url, sim)]
    yield url, servers[0], servers[1]
    for server in servers:
        server.stop()


# --- Several servers ----------------------------------------------------------------------------

def test_a_user_added_with_the_command_logs_in_on_one_server_and_is_known_on_the_other(shared, tmp_path):
    url, a, b = shared
    added = user_command(url, tmp_path / "cli" / "data", "add", "alice", "--admin", stdin=PASSWORD + "\n")
    assert added.returncode == 0, added.stderr
    listed = user_command(url, tmp_path / "cli" / "data", "list")
    assert listed.stdout.split()[:2] == ["alice", "admin"]

    first = log_in(a, "alice", PASSWORD)
    assert first.status_code == 204, first.text
    on_a = first.cookies[SESSION_COOKIE]
    assert me(b, on_a) == 200  # A's session is B's too

    second = log_in(b, "alice", PASSWORD)  # B's login used to rewrite the sessions file without A's
    assert second.status_code == 204
    on_b = second.cookies[SESSION_COOKIE]
    assert me(a, on_a) == 200 and me(a, on_b) == 200 and me(b, on_a) == 200

    out = httpx.post(f"{b.base_url}/api/auth/logout", cookies={SESSION_COOKIE: on_a})
    assert out.status_code == 204
    assert me(a, on_a) == 401 and me(b, on_a) == 401  # ended everywhere
    assert me(a, on_b) == 200

    assert user_command(url, tmp_path / "cli" / "data", "passwd", "alice", stdin="a newer password\n").returncode == 0
    assert me(a, on_b) == 401 and me(b, on_b) == 401
    assert log_in(b, "alice", "a newer password").status_code == 204
    no_accounts_on_disk(a, b)
    assert not (tmp_path / "cli" / "data" / "users.json").exists()


def test_wrong_passwords_spread_over_two_servers_meet_one_limit(shared):
    url, a, b = shared
    add_users(url, ("alice", A_PASSWORD, True))
    for i in range(FAILURES_PER_USER):  # alternating A, B: each server saw at most three
        assert log_in((a, b)[i % 2], "alice", f"wrong guess {i}").status_code == 401
    for server in (a, b):
        refused = log_in(server, "alice", A_PASSWORD)  # counted before it is checked: refused, right or not
        assert refused.status_code == 429, (server.base_url, refused.text)
        assert 0 < int(refused.headers["retry-after"]) <= 15 * 60


def test_a_repeated_wrong_password_counts_once_across_servers(shared):
    url, a, b = shared
    add_users(url, ("alice", A_PASSWORD, True))
    for i in range(FAILURES_PER_USER * 2):
        assert log_in((a, b)[i % 2], "alice", "stale saved password").status_code == 401
    assert log_in(b, "alice", A_PASSWORD).status_code == 204


def test_a_server_restarted_with_an_empty_data_dir_keeps_users_and_sessions(tmp_path, sim, redis_server):
    url = redis_url(redis_server)
    add_users(url, ("alice", A_PASSWORD, True))
    a = start(tmp_path, "a", url, sim)
    try:
        response = log_in(a, "alice", A_PASSWORD)
        assert response.status_code == 204
        session = response.cookies[SESSION_COOKIE]
    finally:
        a.stop()
    fresh = start(tmp_path, "a-again", url, sim)  # another machine, as it were: nothing on its disk
    try:
        assert me(fresh, session) == 200
        assert log_in(fresh, "alice", A_PASSWORD).status_code == 204
        no_accounts_on_disk(fresh)
    finally:
        fresh.stop()


def test_a_session_ends_in_redis_by_its_idle_expiry(tmp_path, sim, redis_server):
    url = redis_url(redis_server)
    add_users(url, ("alice", A_PASSWORD, True))
    # 0.002 h = 7.2 s: short, with room for a loaded machine's pauses between login and the checks.
    a, b = start(tmp_path, "a", url, sim, SESSION_HOURS="0.002"), start(tmp_path, "b", url, sim, SESSION_HOURS="0.002")
    client = sync_redis.Redis.from_url(url)
    try:
        response = log_in(a, "alice", A_PASSWORD)
        session = response.cookies[SESSION_COOKIE]
        key = f"chat:session:{_digest(session)}".encode()
        assert client.exists(key) and 0 < client.pttl(key) <= 7200  # SESSION_HOURS as a Redis TTL
        assert me(b, session) == 200
        assert session.encode() not in b"".join(client.keys("chat:*"))  # only its digest is a key
        deadline = time.monotonic() + 20
        while client.exists(key):  # Redis ends it itself: no server is asked meanwhile
            assert time.monotonic() < deadline, "the session never expired"
            time.sleep(0.1)
        assert me(a, session) == 401 and me(b, session) == 401
    finally:
        client.close()
        a.stop()
        b.stop()


async def test_a_session_in_use_slides_past_its_idle_time_in_redis_and_ends_once_unused(redis_server, sim, monkeypatch,
                                                                                       tmp_path):
    """Each use recorded (here every 0.5 s rather than every minute) pushes the Redis TTL back."""
    monkeypatch.setattr(auth, "TOUCH_SECONDS", 0.5)
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, upstream_timeout=5, auth="password",
                        data_dir=tmp_path / "data", store="redis", redis_url=redis_url(redis_server),
                        session_hours=0.002)  # 7.2 s idle: room for a loaded machine's pauses
    async with Server(settings) as server:
        server.accounts.clock = time.time
        await server.accounts.store.add_user("alice", FAST.hash(A_PASSWORD), admin=True, now=time.time())
        client = sync_redis.Redis.from_url(settings.redis_url)
        async with server.client() as page:
            assert (await page.post("/api/auth/login", json={"username": "alice", "password": A_PASSWORD})).status_code == 204
            # Sent by hand: the browser's copy has a Max-Age of whole seconds (3 here), the server's does not.
            cookie = {"cookie": f"{SESSION_COOKIE}={page.cookies[SESSION_COOKIE]}"}
            page.cookies.clear()
            key = f"chat:session:{_digest(cookie['cookie'].partition('=')[2])}"
            ends_unused = time.monotonic() + client.pttl(key) / 1000
            while time.monotonic() < ends_unused + 2:  # in use well past when it would have ended unused
                assert (await page.get("/api/auth/me", headers=cookie)).status_code == 200
                await asyncio.sleep(0.1)
            assert client.exists(key)
            deadline = time.monotonic() + 10
            while client.exists(key):  # then unused: Redis lets it go by itself
                assert time.monotonic() < deadline, "the unused session never expired"
                await asyncio.sleep(0.1)
            assert (await page.get("/api/auth/me", headers=cookie)).status_code == 401
        client.close()


def test_user_remove_ends_the_sessions_on_every_server_and_removes_the_data_from_redis(shared, tmp_path, sim):
    url, a, b = shared
    add_users(url, ("alice", A_PASSWORD, True), ("bob", "bob's long secret", False))
    bob_on_a = log_in(a, "bob", "bob's long secret").cookies[SESSION_COOKIE]
    bob_on_b = log_in(b, "bob", "bob's long secret").cookies[SESSION_COOKIE]
    alice = log_in(b, "alice", A_PASSWORD).cookies[SESSION_COOKIE]
    conv = httpx.post(f"{a.base_url}/api/conversations", json={}, cookies={SESSION_COOKIE: bob_on_a}).json()

    removed = user_command(url, tmp_path / "cli" / "data", "remove", "bob", "--yes")

    assert removed.returncode == 0, removed.stderr
    assert "removed bob and their data: 1 conversations" in removed.stdout
    for server, session in ((a, bob_on_a), (b, bob_on_a), (a, bob_on_b), (b, bob_on_b)):
        assert me(server, session) == 401
    assert log_in(a, "bob", "bob's long secret").status_code == 401
    assert me(a, alice) == 200
    client = sync_redis.Redis.from_url(url)
    try:
        assert not client.exists(f"chat:conv:{conv['id']}")
        assert not [k for k in client.scan_iter(match="chat:session:*")
                    if orjson.loads(client.get(k))["username"] == "bob"]
    finally:
        client.close()
    assert user_command(url, tmp_path / "cli" / "data", "list").stdout.split()[:2] == ["alice", "admin"]


def test_while_redis_is_away_a_session_is_a_503_and_afterwards_it_works_again(tmp_path, sim):
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    server = None
    try:
        add_users(redis.url, ("alice", A_PASSWORD, True))
        server = start(tmp_path, "a", redis.url, sim)
        session = log_in(server, "alice", A_PASSWORD).cookies[SESSION_COOKIE]
        redis.stop()
        answer = httpx.get(f"{server.base_url}/api/conversations", cookies={SESSION_COOKIE: session}, timeout=10)
        assert answer.status_code == 503 and "Redis" in answer.json()["detail"]  # not a 500, not a 401
        assert log_in(server, "alice", A_PASSWORD).status_code == 503
        redis.start()  # the same port and AOF: the session was acknowledged, so it is still there
        deadline = time.monotonic() + 10
        while me(server, session) != 200:
            assert time.monotonic() < deadline, "the session did not come back with Redis"
            time.sleep(0.1)
    finally:
        if server is not None:
            server.stop()
        redis.stop()


# --- One contract, two account stores ------------------------------------------------------------

@pytest.fixture(params=["files", "redis"])
async def account_store(request, tmp_path):
    options = {}
    if request.param == "redis":
        options = {"store": "redis", "redis_url": redis_url(request.getfixturevalue("redis_server"))}
    settings = Settings(_env_file=None, data_dir=tmp_path / "data", **options)
    store = make_store(settings)
    accounts = make_account_store(settings, store)
    yield accounts
    await accounts.close()
    await store.close()


async def test_users_behave_the_same_in_both_stores(account_store: AccountStore):
    carol = await account_store.add_user("carol", None, admin=False, now=0)
    alice = await account_store.add_user("alice", "hash-a", admin=True, now=1)
    root = await account_store.add_user("root", None, admin=True, now=2)
    assert alice["owner"] == "local" and "local" not in (carol["owner"], root["owner"])
    with pytest.raises(BadAccount, match="already"):
        await account_store.add_user("ALICE", None, admin=False, now=3)
    for bad in ("", "a b", "local"):
        with pytest.raises(BadAccount):
            await account_store.add_user(bad, None, admin=False, now=3)
    assert [u["name"] for u in await account_store.users()] == ["carol", "alice", "root"]
    assert await account_store.find_user("Alice") == alice

    digest = _digest("a session id")
    await account_store.save_session(digest, {"username": "alice", "kind": "password", "epoch": alice["epoch"],
                                              "created": time.time(), "last_seen": time.time()}, time.time())
    found = await account_store.session(digest)
    assert found is not None and found[1] == alice
    await account_store.set_password("alice", "hash-b", end_sessions=False)
    assert (await account_store.find_user("alice"))["epoch"] == alice["epoch"]
    assert await account_store.session(digest) is not None
    await account_store.set_password("alice", "hash-c")
    assert (await account_store.find_user("alice"))["epoch"] != alice["epoch"]
    assert await account_store.session(digest) is None  # a new password ends the sessions

    await account_store.save_session(digest, {"username": "carol", "kind": "password", "epoch": carol["epoch"],
                                              "created": time.time(), "last_seen": time.time()}, time.time())
    assert (await account_store.remove_user("CAROL"))["owner"] == carol["owner"]
    assert await account_store.session(digest) is None  # removing a user ends their sessions
    again = await account_store.add_user("carol", None, admin=True, now=4)
    assert again["owner"] not in (carol["owner"], "local")  # owners are never reused, "local" never twice
    with pytest.raises(BadAccount, match="no user"):
        await account_store.remove_user("nobody")


async def test_the_throttle_behaves_the_same_in_both_stores(account_store: AccountStore):
    throttle, now = account_store.throttle, 1_800_000_000.0
    limits: list[tuple[str, int | None]] = [("user:x address:1", 2), ("user:x", None)]
    first = await throttle.reserve(limits, now)
    second = await throttle.reserve(limits, now)
    with pytest.raises(Throttled):  # two in flight fill the limit before either is checked
        await throttle.reserve(limits, now)
    await throttle.refund(second)
    assert await throttle.fail(first, "guess", now)
    again = await throttle.reserve(limits, now + 1)
    assert not await throttle.fail(again, "guess", now + 1)  # the same guess again: counted once
    third = await throttle.reserve(limits, now + 2)
    assert await throttle.fail(third, "other guess", now + 2)
    with pytest.raises(Throttled) as refused:
        await throttle.reserve(limits, now + 3)
    assert refused.value.retry_after == 15 * 60 - 2  # until the oldest guess leaves the window
    assert await throttle.turn("user:x", 2, 0.5, now + 3) == 0
    await throttle.clear("user:x address:1")
    await throttle.refund(await throttle.reserve(limits, now + 3))
    assert (await throttle.reserve(limits, now + 15 * 60 + 1)) is not None  # the window moved on


async def test_an_export_imported_elsewhere_reads_back_the_same(account_store: AccountStore, tmp_path):
    now = time.time()
    user = {"name": "dora", "admin": True, "password_hash": "h", "created_at": "2026-01-01T00:00:00Z",
            "owner": "u-0123456789abcdef", "epoch": "e1"}
    session = {"username": "dora", "kind": "password", "epoch": "e1", "created": now - 100, "last_seen": now - 50}
    dump = AccountsDump(users=[user], local_owner_taken=True,
                        sessions=[(_digest("x"), session, account_store.idle_seconds - 50)])
    for _ in range(2):  # repeatable
        await account_store.import_accounts(dump)
    back = await account_store.export_accounts()
    assert back.users == [user] and back.local_owner_taken
    [(digest, record, left)] = back.sessions
    assert (digest, record) == (_digest("x"), session)
    assert abs(left - (account_store.idle_seconds - 50)) < 5
    # A later admin does not inherit "local": the flag came along.
    assert (await account_store.add_user("eve", None, admin=True, now=now))["owner"] != "local"


# --- Migration ------------------------------------------------------------------------------------

def run_migrate(*args: str) -> str:
    done = subprocess.run([sys.executable, "server.py", "migrate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_migrate_files_redis_files_keeps_users_and_sessions(tmp_path, redis_server, sim):
    source_dir, back_dir = tmp_path / "source", tmp_path / "back"
    users = UserFile(source_dir)
    users.add("alice", FAST.hash(A_PASSWORD), admin=True, now=time.time())
    users.add("bob", None, admin=False, now=time.time())
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=source_dir, auth="password")
    accounts = Accounts(settings, FileAccountStore(source_dir, settings.session_hours * 3600), hasher=FAST)
    sessions = [await accounts.login("alice", A_PASSWORD, "192.0.2.1") for _ in range(2)]
    before_users = orjson.loads((source_dir / "users.json").read_bytes())
    before_sessions = orjson.loads((source_dir / "sessions.json").read_bytes())["sessions"]
    assert len(before_sessions) == 2

    prefix = unique_prefix()
    redis_args = ["--redis-url", redis_server.url, "--redis-prefix", prefix]
    out = run_migrate("--from", "files", "--to", "redis", "--data-dir", str(source_dir), *redis_args)
    assert "2 users, 2 sessions" in out
    client = sync_redis.Redis.from_url(redis_server.url)
    keys_once = sorted(client.scan_iter(match=f"{prefix}*"))
    run_migrate("--from", "files", "--to", "redis", "--data-dir", str(source_dir), *redis_args)
    assert sorted(client.scan_iter(match=f"{prefix}*")) == keys_once  # again: nothing doubled
    for session_id in sessions:  # each keeps its digest and what it had left of SESSION_HOURS
        left = client.pttl(f"{prefix}session:{_digest(session_id)}") / 1000
        assert settings.session_hours * 3600 - 60 < left <= settings.session_hours * 3600
    client.close()

    run_migrate("--from", "redis", "--to", "files", "--data-dir", str(back_dir), *redis_args)
    run_migrate("--from", "redis", "--to", "files", "--data-dir", str(back_dir), *redis_args)
    after_users = orjson.loads((back_dir / "users.json").read_bytes())
    assert after_users["users"] == before_users["users"]
    assert after_users["local_owner_taken"] is True
    assert orjson.loads((back_dir / "sessions.json").read_bytes())["sessions"] == before_sessions
    # And the sessions work where they landed.
    back = Accounts(settings.model_copy(update={"data_dir": back_dir}),
                    FileAccountStore(back_dir, settings.session_hours * 3600), hasher=FAST)
    for session_id in sessions:
        user = await back.authenticate({"headers": [], "client": ("192.0.2.1", 1)},
                                       {"cookie": f"{SESSION_COOKIE}={session_id}"})
        assert user is not None and user.name == "alice"
