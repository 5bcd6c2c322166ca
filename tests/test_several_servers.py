"""Several server processes on one Redis (STORE=redis): what one makes, the other lists, reads and
continues; a turn running on one is 409 on the other; ownership holds the same on both."""

from __future__ import annotations

import itertools
import signal
import threading
import time

import httpx
import pytest

from auth import UserFile
from redis_support import RedisServer, redis_server  # noqa: F401  (the fixture)
from simulator import Script, steps
from support import LiveServer, parse_sse
from test_auth import A_PASSWORD, B_PASSWORD, FAST

_databases = itertools.count(1)


@pytest.fixture
def pair(tmp_path, sim, redis_server):  # noqa: F811
    """Two servers on one Redis database of their own, each with its own (unused) data directory."""
    env = {"GATEWAY_BASE_URL": sim.base_url, "STORE": "redis",
           "REDIS_URL": f"redis://127.0.0.1:{redis_server.port}/{next(_databases) % 16}"}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    first = LiveServer(tmp_path / "a" / "data", env)
    second = LiveServer(tmp_path / "b" / "data", env)
    yield first, second
    first.stop()
    second.stop()


def test_a_conversation_made_on_one_server_is_listed_read_and_continued_on_the_other(pair, sim):
    a, b = pair
    conv = httpx.post(f"{a.base_url}/api/conversations", json={}).json()
    sim.enqueue(Script(steps=[steps.Text("Made on A.")]), Script(steps=[steps.Text("Continued on B.")]))
    assert "event: done" in httpx.post(f"{a.base_url}/api/conversations/{conv['id']}/messages",
                                       json={"content": "hello A"}, timeout=10).text

    assert [c["id"] for c in httpx.get(f"{b.base_url}/api/conversations").json()] == [conv["id"]]
    assert "event: done" in httpx.post(f"{b.base_url}/api/conversations/{conv['id']}/messages",
                                       json={"content": "hello B"}, timeout=10).text
    stored = httpx.get(f"{a.base_url}/api/conversations/{conv['id']}").json()
    assert [m["content"] for m in stored["messages"]] == ["hello A", "Made on A.", "hello B", "Continued on B."]
    search = httpx.get(f"{a.base_url}/api/search", params={"q": "hello"})
    assert search.status_code == 501 and "STORE=redis" in search.json()["detail"]


def test_a_turn_running_on_one_server_is_409_on_the_other(pair, sim):
    a, b = pair
    conv = httpx.post(f"{a.base_url}/api/conversations", json={}).json()
    sim.enqueue(Script(steps=[steps.Text("Slow "), steps.Sleep(1.5), steps.Text("reply.")]))
    started = threading.Event()
    result = {}

    def run_on_a() -> None:
        with httpx.stream("POST", f"{a.base_url}/api/conversations/{conv['id']}/messages",
                          json={"content": "take your time"}, timeout=20) as response:
            text = ""
            for chunk in response.iter_text():
                text += chunk
                if "event: delta" in text:
                    started.set()
            result["text"] = text

    runner = threading.Thread(target=run_on_a)
    runner.start()
    assert started.wait(10), "the turn on A never streamed"
    try:
        busy = httpx.post(f"{b.base_url}/api/conversations/{conv['id']}/messages", json={"content": "me too"})
        seen = httpx.get(f"{b.base_url}/api/conversations/{conv['id']}").json()
    finally:
        runner.join(20)

    assert busy.status_code == 409 and seen["streaming"] is True
    assert parse_sse(result["text"])[-1][0] == "done"


def test_ownership_holds_the_same_on_both_servers(tmp_path, sim, redis_server):  # noqa: F811
    database = f"redis://127.0.0.1:{redis_server.port}/{next(_databases) % 16}"
    servers = []
    for name in ("a", "b"):
        data_dir = tmp_path / name / "data"
        users = UserFile(data_dir)
        users.add("alice", FAST.hash(A_PASSWORD), admin=True, now=0)
        users.add("bob", FAST.hash(B_PASSWORD), admin=False, now=0)
        servers.append(LiveServer(data_dir, {"GATEWAY_BASE_URL": sim.base_url, "STORE": "redis",
                                             "REDIS_URL": database, "AUTH": "password"}))
    a, b = servers
    try:
        with httpx.Client(base_url=a.base_url) as alice, httpx.Client(base_url=b.base_url) as bob, \
                httpx.Client(base_url=b.base_url) as alice_on_b:
            for client, name, password in ((alice, "alice", A_PASSWORD), (bob, "bob", B_PASSWORD),
                                           (alice_on_b, "alice", A_PASSWORD)):
                assert client.post("/api/auth/login", json={"username": name, "password": password}).status_code == 204
            conv = alice.post("/api/conversations", json={}).json()

            assert bob.get(f"/api/conversations/{conv['id']}").status_code == 404
            assert bob.get("/api/conversations").json() == []
            assert alice_on_b.get(f"/api/conversations/{conv['id']}").status_code == 200
    finally:
        a.stop()
        b.stop()


@pytest.fixture
def own_redis(tmp_path, sim):
    """A server on a Redis of its own, which the test may kill and start again."""
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    (tmp_path / "a").mkdir()
    server = LiveServer(tmp_path / "a" / "data", {"GATEWAY_BASE_URL": sim.base_url, "STORE": "redis",
                                                  "REDIS_URL": redis.url})
    yield redis, server
    server.stop()
    redis.stop()


def test_while_redis_is_down_requests_answer_503_naming_it_and_it_recovers_without_a_restart(own_redis, sim):
    redis, server = own_redis
    conv = httpx.post(f"{server.base_url}/api/conversations", json={}).json()
    sim.enqueue(Script(steps=[steps.Text("Kept.")]))
    httpx.post(f"{server.base_url}/api/conversations/{conv['id']}/messages", json={"content": "keep me"})

    redis.stop(signal.SIGKILL)
    down = httpx.get(f"{server.base_url}/api/conversations", timeout=20)
    turn = httpx.post(f"{server.base_url}/api/conversations/{conv['id']}/messages",
                      json={"content": "now?"}, timeout=20)
    redis.start()
    back = httpx.get(f"{server.base_url}/api/conversations/{conv['id']}", timeout=20)

    assert down.status_code == 503 and "Redis" in down.json()["detail"]
    assert turn.status_code == 503 and "Redis" in turn.json()["detail"]
    assert back.status_code == 200
    assert [m["content"] for m in back.json()["messages"]] == ["keep me", "Kept."], "nothing acknowledged was lost"


def test_a_turn_running_when_redis_goes_away_ends_with_a_clear_error(own_redis, sim):
    redis, server = own_redis
    conv = httpx.post(f"{server.base_url}/api/conversations", json={}).json()
    sim.enqueue(Script(steps=[steps.Text("Half "), steps.Sleep(1.0), steps.Text("and the rest.")]))
    text = ""
    with httpx.stream("POST", f"{server.base_url}/api/conversations/{conv['id']}/messages",
                      json={"content": "go"}, timeout=30) as response:
        for chunk in response.iter_text():
            text += chunk
            if "event: delta" in text and redis.process is not None:
                redis.stop(signal.SIGKILL)
    redis.start()
    deadline = time.monotonic() + 10  # the turn releases its lock as soon as Redis answers again
    while httpx.get(f"{server.base_url}/api/conversations/{conv['id']}").json()["streaming"]:
        assert time.monotonic() < deadline, "the conversation stayed busy after Redis came back"
        time.sleep(0.1)
    sim.enqueue(Script(steps=[steps.Text("Back.")]))
    again = httpx.post(f"{server.base_url}/api/conversations/{conv['id']}/messages",
                       json={"content": "again"}, timeout=30).text

    assert parse_sse(text), text
    name, error = parse_sse(text)[-1]
    assert name == "error" and error["kind"] == "storage" and "Redis" in error["message"]
    assert parse_sse(again)[-1][0] == "done"


def test_a_turn_longer_than_the_lock_expiry_keeps_its_lock_by_renewing_it(tmp_path, sim, redis_server):  # noqa: F811
    env = {"GATEWAY_BASE_URL": sim.base_url, "STORE": "redis", "TURN_LOCK_SECONDS": "0.6",
           "REDIS_URL": f"redis://127.0.0.1:{redis_server.port}/{next(_databases) % 16}"}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    a, b = LiveServer(tmp_path / "a" / "data", env), LiveServer(tmp_path / "b" / "data", env)
    try:
        conv = httpx.post(f"{a.base_url}/api/conversations", json={}).json()
        sim.enqueue(Script(steps=[steps.Text("Slow ")] + [steps.Sleep(0.4), steps.Text("and ")] * 5
                           + [steps.Text("done.")]))
        busy, text = [], ""
        with httpx.stream("POST", f"{a.base_url}/api/conversations/{conv['id']}/messages",
                          json={"content": "take longer than the lock"}, timeout=30) as response:
            for chunk in response.iter_text():
                text += chunk
                if text.count("event: delta") >= 3 and not busy:  # past one lock expiry by now
                    busy.append(httpx.post(f"{b.base_url}/api/conversations/{conv['id']}/messages",
                                           json={"content": "mine now?"}).status_code)
        stored = httpx.get(f"{b.base_url}/api/conversations/{conv['id']}").json()
    finally:
        a.stop()
        b.stop()

    assert busy == [409]
    assert parse_sse(text)[-1][0] == "done"
    assert stored["messages"][-1]["content"] == "Slow and and and and and done."
