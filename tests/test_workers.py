"""WORKERS=2 (STORE=redis): two server processes accepting on one port, started as `make run`
starts them (`python server.py`). Each worker does what a separate server does: the streams of
either complete, a turn running on one is stopped and re-attached through the other, and one
killed mid-reply is noticed by the other within a few heartbeats. A worker is told apart by
/healthz (`worker`, `pid`); a request goes to a chosen worker over a kept-alive connection whose
first request that worker answered. Also here: a new server builds its search index from the
store in the background and says so in /healthz."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from chatserver.app import create_app
from chatserver.search import follow
from chatserver.store.files import FileStore
from gateway_sim.simulator import Script, steps
from support import ROOT, LiveServer, parse_sse
from test_reattach import WHOLE, Reader, has_delta, slow_reply, start_conversation, text_of
from test_serving import MAKE_RUN, read_json

# A low soft open-file limit, as a shell may give; `make run` raises it before the workers are forked.
LOW_FILE_LIMIT = ("import resource; hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
                  "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard)); ")
_databases = itertools.count(8)  # Redis databases 8..15 here; test_several_servers counts from 1


def workers_env(sim, redis_server, **extra: str) -> dict[str, str]:
    return {"GATEWAY_BASE_URL": sim.base_url, "STORE": "redis", "WORKERS": "2", "HEARTBEAT_SECONDS": "0.5",
            "CHECKPOINT_SECONDS": "0.2",
            "REDIS_URL": f"redis://127.0.0.1:{redis_server.port}/{next(_databases) % 16}", **extra}


@pytest.fixture
def server(tmp_path, sim, redis_server):
    live = LiveServer(tmp_path / "data", workers_env(sim, redis_server), launch=MAKE_RUN)
    yield live
    live.stop()


def pinned(server: LiveServer, worker: int, timeout: float = 20) -> tuple[httpx.Client, int]:
    """A client whose one kept-alive connection `worker` accepted, and that worker's pid.

    Connections are dealt to whichever worker accepts first, so new ones are opened until the
    wanted worker answers one (bounded; it also waits for a worker still starting)."""
    deadline = time.monotonic() + timeout
    while True:
        client = httpx.Client(base_url=server.base_url, timeout=20,
                              limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
        try:
            health = client.get("/healthz").json()
            if health["worker"] == worker:
                return client, health["pid"]
        except httpx.HTTPError:
            pass
        client.close()
        assert time.monotonic() < deadline, f"worker {worker} never answered"


def worker_pids(server: LiveServer) -> set[int]:
    """The supervisor's children now."""
    children = set()
    for task in os.listdir(f"/proc/{server.process.pid}/task"):
        with open(f"/proc/{server.process.pid}/task/{task}/children") as f:
            children |= {int(pid) for pid in f.read().split()}
    return children


def test_200_simultaneous_streams_on_two_workers_all_complete(server, sim):
    one, pid_one = pinned(server, 1)
    two, pid_two = pinned(server, 2)
    one.close()
    two.close()
    assert pid_one != pid_two and {pid_one, pid_two} == worker_pids(server)
    n = 200
    conv_ids = [start_conversation(server.base_url) for _ in range(n)]
    sim.enqueue(*[Script(steps=[steps.Text(f"Reply {i} "), steps.Sleep(0.2), steps.Text("done.")]) for i in range(n)])

    async def run_all() -> list[str]:
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)  # a connection per stream
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits) as client:
            async def turn(conv_id: str) -> str:
                answer = await client.post(f"/api/conversations/{conv_id}/messages", json={"content": "hi"})
                assert answer.status_code == 200, answer.text
                return answer.text
            return await asyncio.gather(*(turn(c) for c in conv_ids))

    began = time.monotonic()
    bodies = asyncio.run(run_all())
    took = time.monotonic() - began
    print(f"{n} streams over two workers took {took:.1f} s")
    ends = [parse_sse(body)[-1] for body in bodies]
    assert [name for name, _ in ends] == ["done"] * n
    assert {data["status"] for _, data in ends} == {"complete"}
    texts = {"".join(d["text"] for name, d in parse_sse(body) if name == "delta") for body in bodies}
    assert len(texts) == n, "every stream got its own reply, whole"
    stored = httpx.get(f"{server.base_url}/api/conversations").json()
    assert len(stored) == n and not any(c["streaming"] for c in stored)
    # Each worker keeps its own search index; none is written by two processes.
    index = server.data_dir / "index"
    assert sorted(p.name for p in index.iterdir() if p.is_dir()) == ["worker-1", "worker-2"]
    assert (index / "worker-1" / "search-redis.sqlite3").exists() and (index / "worker-2" / "search-redis.sqlite3").exists()
    assert not (index / "search-redis.sqlite3").exists()


def test_a_turn_on_one_worker_is_stopped_and_reattached_through_the_other(server, sim):
    one, _ = pinned(server, 1)
    two, _ = pinned(server, 2)
    stopper, _ = pinned(server, 2)
    try:
        # Re-attach: a turn begun on worker 1, hung up after its first delta, read on through worker 2.
        sim.enqueue(slow_reply())
        conv_id = start_conversation(server.base_url)
        url = f"/api/conversations/{conv_id}"
        with one.stream("POST", f"{url}/messages", json={"content": "tell me a long story"}) as response:
            for line in response.iter_lines():
                if line.startswith("event: delta"):
                    break
        rest = Reader("GET", f"{url}/stream", client=two, headers={"Last-Event-ID": "1"}).join()
        assert [seq for seq, _, _ in rest] == list(range(2, 2 + len(rest))), "every later event, once, in order"
        assert rest[-1][1] == "done" and rest[-1][2]["status"] == "complete" and text_of(rest) == WHOLE
        # After the end, any worker replays it alike: asked over fresh connections, whichever answers.
        for _ in range(6):
            assert Reader("GET", f"{server.base_url}{url}/stream?after=1").join() == rest

        # Stop: a turn begun on worker 1, stopped by a request worker 2 answers.
        sim.enqueue(slow_reply())
        post = Reader("POST", f"{url}/messages", client=one, json={"content": "another long one"})
        post.wait_for(has_delta)
        follower = Reader("GET", f"{url}/stream", client=two, headers={"Last-Event-ID": "1"})
        follower.wait_for(has_delta)
        assert stopper.get(url).json()["streaming"] is True
        assert stopper.post(f"{url}/stop", json={}).status_code == 204
        after = stopper.get(url).json()
        record = sim.wait_for_disconnect(timeout=5)
        assert not record.completed, "worker 1's upstream call went on after Stop through worker 2"
        events = post.join()
        assert events[-1][1] == "done" and events[-1][2]["status"] == "interrupted"
        assert follower.join() == events[1:], "worker 2's follower got every event after 1, once, to the same end"
        assert after["streaming"] is False and after["turn"] is None
        assert after["messages"][-1]["status"] == "interrupted" and after["messages"][-1]["content"] == text_of(events)
    finally:
        for client in (one, two, stopper):
            client.close()


def is_checkpoint(message: dict) -> bool:
    return message["role"] == "assistant" and message.get("status") == "streaming" and bool(message["content"])


def test_a_worker_killed_mid_reply_is_noticed_by_the_other_within_a_few_heartbeats(server, sim):
    """SIGKILL the worker running a slow reply: a follower on the other ends interrupted within a
    few seconds (not the lock's 30), and a new turn is accepted right after."""
    one, pid_one = pinned(server, 1)
    two, _ = pinned(server, 2)
    try:
        sim.enqueue(slow_reply(pause=0.5))  # twenty seconds of reply: the kill lands mid-reply
        conv_id = start_conversation(server.base_url)
        url = f"/api/conversations/{conv_id}"
        post = Reader("POST", f"{url}/messages", client=one, json={"content": "go slowly"})
        post.wait_for(has_delta)
        follower = Reader("GET", f"{url}/stream", client=two, headers={"Last-Event-ID": "1"})
        follower.wait_for(has_delta)
        deadline = time.monotonic() + 10
        while not is_checkpoint(httpx.get(f"{server.base_url}{url}").json()["messages"][-1]):
            assert time.monotonic() < deadline, "no checkpoint reached Redis"
            time.sleep(0.02)

        os.kill(pid_one, signal.SIGKILL)
        killed = time.monotonic()
        assert follower.finished.wait(10), "worker 2's follower never learned that worker 1 died"
        noticed_after = time.monotonic() - killed
        events = follower.join()
        sim.enqueue(Script(steps=[steps.Text("Back again.")]))
        again = httpx.post(f"{server.base_url}{url}/messages", json={"content": "go on"}, timeout=10)
        accepted_after = time.monotonic() - killed
        conv = httpx.get(f"{server.base_url}{url}").json()
        # The supervisor started another worker 1 in the dead one's place.
        replaced, pid_new = pinned(server, 1)
        replaced.close()
    finally:
        one.close()
        two.close()
    post.join()

    print(f"follower ended {noticed_after:.2f} s after the kill; a new turn was answered {accepted_after:.2f} s after")
    assert noticed_after < 4.5  # three missed beats of 0.5 s, the follower's one-second wait, slack
    name, data = events[-1][1], events[-1][2]
    assert name == "done" and data["status"] == "interrupted"
    assert [seq for seq, _, _ in events] == list(range(2, 2 + len(events)))
    assert again.status_code == 200 and parse_sse(again.text)[-1][0] == "done", again.text
    assert [(m["role"], m.get("status")) for m in conv["messages"]] == [
        ("user", None), ("assistant", "interrupted"), ("user", None), ("assistant", "complete")]
    assert conv["streaming"] is False and conv["totals"]["turns"] == 2
    assert pid_new != pid_one
    assert "worker 1 (pid %d) was killed by signal 9" % pid_one in server.log()


def open_files_limit(pid: int) -> tuple[str, str]:
    with open(f"/proc/{pid}/limits") as f:
        soft, hard = next(line for line in f if line.startswith("Max open files")).split()[3:5]
    return soft, hard


def test_each_worker_keeps_the_servers_limits(tmp_path, sim, redis_server):
    """The request-head timer (and with it the guarded protocol) and the open-file limit hold in
    every worker, not only in the process that bound the port."""
    timeout = 1.0
    live = LiveServer(tmp_path / "data", workers_env(sim, redis_server, HEADER_TIMEOUT=str(timeout)),
                      launch=LOW_FILE_LIMIT + MAKE_RUN)
    trickling: dict[int, socket.socket] = {}
    try:
        deadline = time.monotonic() + 20
        while len(trickling) < 2:  # a kept-alive connection of each worker, its next request head never finished
            assert time.monotonic() < deadline, f"only workers {sorted(trickling)} answered"
            sock = socket.create_connection(("127.0.0.1", live.port), timeout=5)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            worker = read_json(sock)["worker"]
            if worker in trickling:
                sock.close()
                continue
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\nx-slow: ")
            trickling[worker] = sock
        began = time.monotonic()
        for worker, sock in trickling.items():
            sock.settimeout(timeout + 5)
            assert sock.recv(1024) == b"", f"worker {worker} kept a connection whose head never came"
        assert time.monotonic() - began < timeout + 5
        assert "sent no complete request head" in live.log()
        for pid in worker_pids(live):
            soft, hard = open_files_limit(pid)
            assert soft == hard, (pid, soft, hard)
    finally:
        for sock in trickling.values():
            sock.close()
        live.stop()


def test_workers_with_the_file_store_refuse_to_start_saying_why(tmp_path, sim):
    env = {k: v for k, v in os.environ.items() if k not in ("ACCESS_TOKEN", "STORE")}
    started = subprocess.run([sys.executable, "server.py"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env={**env, "DATA_DIR": str(tmp_path / "data"), "GATEWAY_BASE_URL": sim.base_url,
                                  "WORKERS": "2", "STORE": "files", "PORT": "1"})
    assert started.returncode != 0
    assert "configuration error" in started.stderr and "WORKERS=2 needs STORE=redis" in started.stderr
    assert "one process owns the conversation files" in started.stderr
    assert not (tmp_path / "data").exists(), "nothing was started"


# --- A new server builds its search index from the store, in the background ---------------------

async def test_a_new_server_builds_its_search_index_in_the_background_and_says_so(settings, sim, monkeypatch):
    sim.enqueue(Script(steps=[steps.Text("Parsnips keep well in sand.")]))
    first = create_app(settings)
    async with first.router.lifespan_context(first):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=first), base_url="http://127.0.0.1") as c:
            await asyncio.wait_for(asyncio.shield(first.state.search.ready), 10)
            assert (await c.get("/healthz")).json()["search"] == "ready"
            conv = (await c.post("/api/conversations", json={})).json()
            assert "event: done" in (await c.post(f"/api/conversations/{conv['id']}/messages",
                                                  json={"content": "how do I store parsnips"})).text
    for path in settings.index_dir.glob("search*"):
        path.unlink()  # a new server: no index of its own yet

    gate = asyncio.Event()
    every = FileStore.every_conversation

    async def slow_every_conversation(self):
        await gate.wait()  # the store is large: reading it takes until the test opens the gate
        async for conv_ in every(self):
            yield conv_

    monkeypatch.setattr(FileStore, "every_conversation", slow_every_conversation)
    monkeypatch.setattr(follow, "BUILD_WAIT", 0.2)
    second = create_app(settings)
    async with second.router.lifespan_context(second):  # it starts without waiting for the index
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=second), base_url="http://127.0.0.1") as c:
            health = (await c.get("/healthz")).json()
            early = await c.get("/api/search", params={"q": "parsnips"})
            monkeypatch.setattr(follow, "BUILD_WAIT", 10.0)
            waiting = asyncio.ensure_future(c.get("/api/search", params={"q": "parsnips"}))
            await asyncio.wait([waiting], timeout=0.2)
            assert not waiting.done(), "a search during the build waits for it (bounded)"
            gate.set()
            answer = await asyncio.wait_for(waiting, 10)
            await asyncio.wait_for(asyncio.shield(second.state.search.ready), 10)
            after = (await c.get("/healthz")).json()

    assert health["search"] == "building" and health["ok"] is True
    assert early.status_code == 503 and "still being built" in early.json()["detail"]
    assert early.headers["retry-after"] == "2"
    assert answer.status_code == 200 and {hit["conversation_id"] for hit in answer.json()} == {conv["id"]}
    assert after["search"] == "ready"


async def test_healthz_names_the_one_worker_of_a_single_process(client):
    health = (await client.get("/healthz")).json()
    assert (health["worker"], health["workers"], health["pid"]) == (1, 1, os.getpid())
    assert health["search"] in ("building", "ready")


async def test_user_remove_forgets_the_person_in_every_workers_index(settings, sim):
    """`server.py user remove` drops the person's rows from each worker's index too, not only from
    the single server's, so nothing of theirs stays on disk until the workers next start."""
    from chatserver.accounts.cli import remove_data
    from chatserver.attachments import store as att
    from chatserver.search.index import SearchIndex

    sim.enqueue(Script(steps=[steps.Text("Parsnips keep well in sand.")]))
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            conv = (await c.post("/api/conversations", json={})).json()
            await c.post(f"/api/conversations/{conv['id']}/messages", json={"content": "parsnips?"})
            stored = (await c.get(f"/api/conversations/{conv['id']}")).json()
    indexes = [SearchIndex(settings.index_dir / f"worker-{n}" / "search-redis.sqlite3") for n in (1, 2)]
    for index in indexes:
        await index.open()
        await index.index_conversation("local", stored)
        assert await index.search("local", "parsnips")
        await index.close()
    scope = att.conversation_scope(conv["id"])
    for n in (1, 2):  # each worker's passage index, as a search there would have filled it
        passages = att.SearchIndex(settings.index_dir / f"worker-{n}" / att.INDEX_FILE)
        passages.add(scope, {"id": "file00001", "name": "roots.txt"},
                     [{"page": 1, "label": "line 1", "text": "Parsnips keep well in sand."}])
        passages.close()

    assert await remove_data(settings, "local") == 1

    for n in (1, 2):
        passages = att.SearchIndex(settings.index_dir / f"worker-{n}" / att.INDEX_FILE)
        try:
            assert passages.search({scope.key: scope}, {"file00001"}, "parsnips") == [], \
                f"worker {n}'s passage index kept the removed person's file text"
        finally:
            passages.close()

    for n in (1, 2):
        index = SearchIndex(settings.index_dir / f"worker-{n}" / "search-redis.sqlite3")
        try:
            assert await index.search("local", "parsnips") == [], f"worker {n}'s index kept the removed person's text"
        finally:
            await index.close()
