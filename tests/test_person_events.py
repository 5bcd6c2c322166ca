"""`GET /api/events`: a person's other pages hear of renames, new conversations, titles, turns and
deletions within a second, from whichever server made them; another person hears nothing."""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
import signal
import threading
import time

import httpx
import pytest

from chatserver.accounts.auth import UserFile
from gateway_sim.simulator import Script, steps
from support import LiveServer
from test_auth import A_PASSWORD, B_PASSWORD, FAST
from test_shared_accounts import add_users

WITHIN = 1.0  # seconds a change may take to reach another page: the bound
_databases = itertools.count(1)


class Listener:
    """A page's `GET /api/events`, read on a thread of its own; `next` waits for a matching event."""

    def __init__(self, base_url: str, cookies: dict | None = None) -> None:
        self.events: queue.Queue[tuple[str, dict]] = queue.Queue()
        self.connected = threading.Event()
        self.status: int | None = None
        self.seen: list[tuple[str, dict]] = []  # every event `next` has read, matching or not
        self._client = httpx.Client(base_url=base_url, cookies=cookies, timeout=httpx.Timeout(5, read=None))
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        assert self.connected.wait(10), "the events stream never answered"

    def _read(self) -> None:
        try:
            with self._client.stream("GET", "/api/events") as response:
                self.status = response.status_code
                self.connected.set()
                name = "message"
                for line in response.iter_lines():
                    if line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        self.events.put((name, json.loads(line[5:])))
                        name = "message"
        except httpx.HTTPError:
            pass  # closed by the test
        finally:
            self.connected.set()

    def next(self, name: str, timeout: float = WITHIN, **fields) -> dict:
        """The first `name` event whose data holds `fields`, within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                got, data = self.events.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append((got, data))
            if got == name and all(data.get(k) == v for k, v in fields.items()):
                return data
        raise AssertionError(f"no {name} event with {fields} within {timeout}s")

    def close(self) -> None:
        self._client.close()
        self._thread.join(5)


def assert_heard_only_own(person: httpx.Client, page: Listener) -> None:
    """Whatever the page heard before a change of its person's own, it was of that person's only.

    Events reach a process's pages in the order they were published, so once the page hears of
    this new conversation it has heard anything published before it.
    """
    mine = person.post("/api/conversations", json={}).json()
    page.next("conversation", id=mine["id"])
    heard = [data["id"] for _, data in page.seen]
    assert set(heard) <= {mine["id"]}, heard


def accounts(data_dir) -> None:
    users = UserFile(data_dir)
    users.add("alice", FAST.hash(A_PASSWORD), admin=True, now=0)
    users.add("bob", FAST.hash(B_PASSWORD), admin=False, now=0)


def logged_in(base_url: str, name: str, password: str) -> httpx.Client:
    client = httpx.Client(base_url=base_url, timeout=10)
    assert client.post("/api/auth/login", json={"username": name, "password": password}).status_code == 204
    return client


@pytest.fixture
def people_server(tmp_path, sim):
    data_dir = tmp_path / "data"
    accounts(data_dir)
    server = LiveServer(data_dir, {"GATEWAY_BASE_URL": sim.base_url, "AUTH": "password", "AUTO_TITLE": "true"})
    yield server
    server.stop()


def test_a_second_page_hears_every_change_of_the_first_and_another_person_hears_none(people_server, sim):
    base = people_server.base_url
    alice, bob = logged_in(base, "alice", A_PASSWORD), logged_in(base, "bob", B_PASSWORD)
    alices_other_tab = Listener(base, dict(alice.cookies))
    bobs_tab = Listener(base, dict(bob.cookies))
    try:
        conv = alice.post("/api/conversations", json={}).json()
        assert alices_other_tab.next("conversation", id=conv["id"])["title"] == conv["title"]

        alice.patch(f"/api/conversations/{conv['id']}", json={"title": "Plans for May"})
        assert alices_other_tab.next("conversation", id=conv["id"], title="Plans for May")

        alice.patch(f"/api/conversations/{conv['id']}", json={"pinned": True})
        assert alices_other_tab.next("conversation", id=conv["id"], pinned=True)

        # A turn: started, the streaming dot on and off, and ended; then the title comes by itself.
        untitled = alice.post("/api/conversations", json={}).json()
        sim.enqueue(Script(steps=[steps.Text("Tulips and daffodils.")]),
                    Script(steps=[steps.Text("Spring bulbs")]))
        assert "event: done" in alice.post(f"/api/conversations/{untitled['id']}/messages",
                                           json={"content": "what should I plant in spring?"}).text
        alices_other_tab.next("turn", id=untitled["id"], state="started")
        alices_other_tab.next("conversation", id=untitled["id"], streaming=True)
        assert alices_other_tab.next("conversation", id=untitled["id"], message_count=2)
        alices_other_tab.next("turn", id=untitled["id"], state="ended")
        alices_other_tab.next("conversation", id=untitled["id"], streaming=False)
        alices_other_tab.next("conversation", id=untitled["id"], title="Spring bulbs", timeout=10)

        assert alice.delete(f"/api/conversations/{conv['id']}").status_code == 204
        alices_other_tab.next("deleted", id=conv["id"])

        assert_heard_only_own(bob, bobs_tab)
    finally:
        alices_other_tab.close()
        bobs_tab.close()
        alice.close()
        bob.close()


def test_the_events_need_a_signed_in_person(people_server):
    assert httpx.get(f"{people_server.base_url}/api/events", timeout=5).status_code == 401


def test_a_change_made_on_one_server_reaches_a_page_connected_to_the_other(tmp_path, sim, redis_server):
    env = {"GATEWAY_BASE_URL": sim.base_url, "STORE": "redis", "AUTH": "password",
           "REDIS_URL": f"redis://127.0.0.1:{redis_server.port}/{next(_databases) % 16}"}
    add_users(env["REDIS_URL"], ("alice", A_PASSWORD, True), ("bob", B_PASSWORD, False))  # in Redis, for both
    servers = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()  # each its own directory, as two machines
            servers.append(LiveServer(tmp_path / name / "data", env))
        a, b = servers
        alice_on_a = logged_in(a.base_url, "alice", A_PASSWORD)
        alice_on_b = Listener(b.base_url, dict(logged_in(b.base_url, "alice", A_PASSWORD).cookies))
        bob = logged_in(b.base_url, "bob", B_PASSWORD)
        bob_on_b = Listener(b.base_url, dict(bob.cookies))
        try:
            conv = alice_on_a.post("/api/conversations", json={}).json()
            alice_on_b.next("conversation", id=conv["id"])
            alice_on_a.patch(f"/api/conversations/{conv['id']}", json={"title": "Made on A"})
            alice_on_b.next("conversation", id=conv["id"], title="Made on A")
            sim.enqueue(Script(steps=[steps.Text("Hello from A.")]))
            assert "event: done" in alice_on_a.post(f"/api/conversations/{conv['id']}/messages",
                                                    json={"content": "hi"}).text
            alice_on_b.next("turn", id=conv["id"], state="started")
            alice_on_b.next("turn", id=conv["id"], state="ended")
            assert alice_on_a.delete(f"/api/conversations/{conv['id']}").status_code == 204
            alice_on_b.next("deleted", id=conv["id"])
            assert_heard_only_own(bob, bob_on_b)
        finally:
            alice_on_b.close()
            bob_on_b.close()
            alice_on_a.close()
            bob.close()
    finally:
        for server in servers:
            server.stop()


def test_a_turn_whose_server_died_ends_for_the_pages_on_the_other(tmp_path, sim, redis_server):
    env = {"GATEWAY_BASE_URL": sim.base_url, "STORE": "redis",
           "REDIS_URL": f"redis://127.0.0.1:{redis_server.port}/{next(_databases) % 16}"}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    a = LiveServer(tmp_path / "a" / "data", env)
    b = LiveServer(tmp_path / "b" / "data", env)
    page_on_b = Listener(b.base_url)
    try:
        conv = httpx.post(f"{a.base_url}/api/conversations", json={}, timeout=10).json()
        sim.enqueue(Script(steps=[steps.Text("A reply that never ends "), steps.Sleep(60)]))
        def ask() -> None:
            with contextlib.suppress(httpx.HTTPError):  # its server is killed mid-answer
                httpx.post(f"{a.base_url}/api/conversations/{conv['id']}/messages", json={"content": "go on"},
                           timeout=70)

        threading.Thread(target=ask, daemon=True).start()
        page_on_b.next("conversation", id=conv["id"], streaming=True, timeout=10)
        killed = time.monotonic()
        a.process.send_signal(signal.SIGKILL)
        # Three missed beats of a second each, and the sweep's own beat: a few seconds, not the lock's 30.
        page_on_b.next("turn", id=conv["id"], state="ended", timeout=10)
        page_on_b.next("conversation", id=conv["id"], streaming=False)
        noticed = time.monotonic() - killed
        assert noticed < 10, noticed
        listed = httpx.get(f"{b.base_url}/api/conversations", timeout=10).json()
        assert [c["streaming"] for c in listed if c["id"] == conv["id"]] == [False]
    finally:
        page_on_b.close()
        a.stop()
        b.stop()


def test_a_server_asked_to_stop_ends_its_open_event_streams_and_exits(live_server):
    """uvicorn waits, with no limit, for every open response before it exits: every open page holds
    an events stream, which must end on the exit signal (sse-starlette's hook on uvicorn sets
    AppStatus.should_exit; TurnResponse watches it)."""
    page = Listener(live_server.base_url)
    try:
        live_server.process.send_signal(signal.SIGTERM)
        # Once shut down, uvicorn raises the signal it caught again: SIGTERM ends the process.
        assert live_server.process.wait(5) == -signal.SIGTERM
        page._thread.join(5)
        assert not page._thread.is_alive(), "the page's stream never ended"
    finally:
        page.close()
