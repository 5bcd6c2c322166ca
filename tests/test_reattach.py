"""A turn belongs to the server (API.md "Turns that outlive the page"): numbered events, re-attach,
an explicit Stop, DELETE mid-stream, checkpoints and crash recovery, through real uvicorn servers
where sockets matter. Hang-up-stops (ON_DISCONNECT=stop) is in test_stop.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from chatserver.config import Settings
from chatserver.conversations.document import new_id, now_iso
from chatserver.store.files import Checkpoint, FileStore, checkpoints_beside
from chatserver.store.redis import RedisStore
from chatserver.turns.pipeline import Turns
from gateway_sim.simulator import Script, steps
from redis_support import unique_prefix
from support import LiveServer, hang_up_after_first_delta, serve

PIECES = [f"piece{i} " for i in range(40)]
WHOLE = "".join(PIECES)


def slow_reply(pause: float = 0.05) -> Script:
    """Forty text pieces, `pause` apart: about two seconds of streaming."""
    return Script(steps=[step for piece in PIECES for step in (steps.Text(piece), steps.Sleep(pause))])


def assert_running(url: str, post: "Reader") -> None:
    """The conversation at `url` shows the turn `post` started as running, with events sent."""
    running = httpx.get(url).json()
    assert running["streaming"] is True
    assert running["turn"]["assistant_message_id"] == post.events[0][2]["assistant_message_id"]
    assert running["turn"]["events"] >= 2


def start_conversation(base_url: str) -> str:
    conv = httpx.post(f"{base_url}/api/conversations", json={}).json()
    httpx.patch(f"{base_url}/api/conversations/{conv['id']}", json={"settings": {"web_search": False, "web_fetch": False}})
    return conv["id"]


def settled(base_url: str, conv_id: str) -> dict:
    """The conversation once no turn holds it (bounded)."""
    deadline = time.monotonic() + 10
    while True:
        conv = httpx.get(f"{base_url}/api/conversations/{conv_id}").json()
        if not conv["streaming"]:
            return conv
        assert time.monotonic() < deadline, "the turn never let the conversation go"
        time.sleep(0.02)


def parse_block(lines: list[str]) -> tuple[int | None, str, dict] | None:
    seq, name, data = None, "message", []
    for line in lines:
        if line.startswith("id:"):
            seq = int(line[3:].strip())
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    return (seq, name, json.loads("\n".join(data))) if data else None


class Reader:
    """One SSE response read on a thread of its own; its (id, event, data) triples as they arrive."""

    def __init__(self, method: str, url: str, **kwargs) -> None:
        self.events: list[tuple[int | None, str, dict]] = []
        self.status: int | None = None
        self.error: httpx.HTTPError | None = None
        self.finished = threading.Event()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(method, url, kwargs), daemon=True)
        self._thread.start()

    def _read(self, method: str, url: str, kwargs: dict) -> None:
        # `client=`: read over that client's (kept-alive) connection instead of a new one.
        client: httpx.Client | None = kwargs.pop("client", None)
        try:
            with (client.stream(method, url, **kwargs) if client is not None
                  else httpx.stream(method, url, timeout=20, **kwargs)) as response:
                self.status = response.status_code
                block: list[str] = []
                for line in response.iter_lines():
                    if line:
                        block.append(line)
                        continue
                    if (event := parse_block(block)) is not None:
                        with self._changed:
                            self.events.append(event)
                            self._changed.notify_all()
                    block = []
        except httpx.HTTPError as exc:
            self.error = exc  # the server went away mid-stream (the SIGKILL test)
        finally:
            with self._changed:
                self.finished.set()
                self._changed.notify_all()

    def wait_for(self, predicate, timeout: float = 10) -> None:
        with self._changed:
            self._changed.wait_for(lambda: predicate(self.events) or self.finished.is_set(), timeout)
            assert predicate(self.events), [name for _, name, _ in self.events]

    def join(self, timeout: float = 15) -> list[tuple[int | None, str, dict]]:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"
        return self.events


def has_delta(events) -> bool:
    return any(name == "delta" for _, name, _ in events)


def text_of(events) -> str:
    return "".join(data["text"] for _, name, data in events if name == "delta")


def test_hang_up_leaves_the_turn_running_and_a_reattach_gets_the_rest_exactly_once(live_server, sim):
    sim.enqueue(slow_reply())
    base = live_server.base_url
    conv_id = start_conversation(base)

    hang_up_after_first_delta(base, conv_id)
    rest = Reader("GET", f"{base}/api/conversations/{conv_id}/stream", headers={"Last-Event-ID": "1"}).join()

    record = sim.wait_for_requests(1)[0]
    assert record.ended.wait(10)
    assert record.disconnected_at is None, "the hang-up reached the provider"
    assert [seq for seq, _, _ in rest] == list(range(2, 2 + len(rest))), "every later event, once, in order"
    assert rest[-1][1] == "done" and rest[-1][2]["status"] == "complete"
    assert text_of(rest) == WHOLE
    conv = settled(base, conv_id)
    replies = [m for m in conv["messages"] if m["role"] == "assistant"]
    assert [(m["content"], m["status"]) for m in replies] == [(WHOLE, "complete")]
    assert conv["turn"] is None and conv["totals"]["turns"] == 1
    # Nothing runs any more: there is nothing to follow.
    assert httpx.get(f"{base}/api/conversations/{conv_id}/stream", headers={"Last-Event-ID": str(rest[-1][0])}
                     ).status_code == 204


def test_two_streams_attached_at_different_times_get_the_same_events_from_their_points_on(live_server, sim):
    sim.enqueue(slow_reply())
    base = live_server.base_url
    conv_id = start_conversation(base)
    url = f"{base}/api/conversations/{conv_id}"

    post = Reader("POST", f"{url}/messages", json={"content": "tell me a long story"})
    post.wait_for(has_delta)
    assert_running(url, post)
    first = Reader("GET", f"{url}/stream?after=0")
    first.wait_for(lambda events: len(events) >= 6)
    seen = first.events[4][0]
    second = Reader("GET", f"{url}/stream", headers={"Last-Event-ID": str(seen)})

    started = post.join()
    assert [seq for seq, _, _ in started] == list(range(1, len(started) + 1))
    assert started[0][1] == "start" and started[-1][1] == "done" and text_of(started) == WHOLE
    assert first.join() == started
    assert second.join() == [event for event in started if event[0] > seen]


def test_stop_from_another_connection_closes_upstream_and_ends_every_stream(live_server, sim):
    sim.enqueue(slow_reply(pause=0.1))
    base = live_server.base_url
    conv_id = start_conversation(base)
    url = f"{base}/api/conversations/{conv_id}"
    post = Reader("POST", f"{url}/messages", json={"content": "tell me a long story"})
    post.wait_for(has_delta)
    follower = Reader("GET", f"{url}/stream", headers={"Last-Event-ID": "0"})
    follower.wait_for(has_delta)

    assert httpx.post(f"{url}/stop", json={}).status_code == 204

    record = sim.wait_for_disconnect(timeout=5)
    assert not record.completed, "the provider finished the reply: Stop did not reach it"
    for events in (post.join(), follower.join()):
        name, data = events[-1][1:]
        assert name == "done" and data["status"] == "interrupted"
        assert data["usage"]["estimated"] is True and data["usage"]["output_tokens"] > 0
    assert follower.events == post.events
    conv = httpx.get(url).json()
    assert conv["streaming"] is False and conv["turn"] is None
    replies = [m for m in conv["messages"] if m["role"] == "assistant"]
    assert [(m["content"], m["status"]) for m in replies] == [(text_of(post.events), "interrupted")]
    assert replies[0]["content"].startswith("piece0 ") and replies[0]["content"] != WHOLE
    assert conv["totals"]["turns"] == 1

    assert httpx.post(f"{url}/stop", json={}).status_code == 204, "nothing runs: still 204"
    assert httpx.post(f"{base}/api/conversations/{'x' * 22}/stop", json={}).status_code == 404
    sim.enqueue(Script(steps=[steps.Text("Fine.")]))
    answer = httpx.post(f"{url}/messages", json={"content": "shorter please"}, timeout=10)
    assert "event: done" in answer.text and "id: 1\r\n" in answer.text


def test_delete_mid_stream_closes_the_upstream_socket(live_server, sim, tmp_path):
    sim.enqueue(slow_reply(pause=0.1))
    base = live_server.base_url
    conv_id = start_conversation(base)
    url = f"{base}/api/conversations/{conv_id}"
    post = Reader("POST", f"{url}/messages", json={"content": "tell me a long story"})
    post.wait_for(has_delta)

    assert httpx.delete(url).status_code == 204

    record = sim.wait_for_disconnect(timeout=5)
    assert not record.completed, "the provider went on generating a reply nobody can read"
    assert post.join()[-1][1] == "done"
    assert httpx.get(url).status_code == 404
    assert not (tmp_path / "data" / "conversations" / f"{conv_id}.json").exists()


def checkpoint_when(conv_file: Path, ready: Callable[[Checkpoint], object], what: str) -> Checkpoint:
    """The newest whole checkpoint beside `conv_file` (the reply alone, where a crash cannot take
    it back) once it is `ready`; polled, within a bound."""
    deadline = time.monotonic() + 10
    while not (found := checkpoints_beside(conv_file)) or not ready(found[0]):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)  # polling the file, bounded by the deadline
    return found[0]


def sigkilled(server: LiveServer) -> None:
    """The server dies mid-turn, as the OOM killer or a power cut would have it."""
    server.process.kill()
    server.process.wait(10)
    server.stop()


@contextlib.contextmanager
def restarted(data_dir: Path, env: dict, conv_id: str) -> Iterator[tuple[LiveServer, dict]]:
    """A new server on the same DATA_DIR and the conversation as it reads it: no turn runs on it."""
    again = LiveServer(data_dir, env)
    try:
        conv = httpx.get(f"{again.base_url}/api/conversations/{conv_id}").json()
        assert conv["streaming"] is False and conv["turn"] is None
        yield again, conv
    finally:
        again.stop()


def test_a_reply_cut_by_sigkill_is_interrupted_after_restart_with_its_checkpoint(tmp_path, sim):
    data_dir = tmp_path / "data"
    env = {"GATEWAY_BASE_URL": sim.base_url, "CHECKPOINT_SECONDS": "0.2"}
    server = LiveServer(data_dir, env)
    try:
        sim.enqueue(slow_reply(pause=0.1))
        conv_id = start_conversation(server.base_url)
        url = f"{server.base_url}/api/conversations/{conv_id}"
        post = Reader("POST", f"{url}/messages", json={"content": "tell me a long story"})
        post.wait_for(lambda events: len(text_of(events)) > len("piece0 piece1 "))
        # The checkpoint is on disk (the reply alone, beside the conversation file), where a crash
        # cannot take it back.
        stored = checkpoint_when(data_dir / "conversations" / f"{conv_id}.json",
                                 lambda c: c.message["content"], "no checkpoint was written").message
        assert stored["role"] == "assistant" and stored["status"] == "streaming"
        checkpointed = stored["content"]
    finally:
        sigkilled(server)
    post.join()

    with restarted(data_dir, env, conv_id) as (again, conv):
        user, reply = conv["messages"]
        assert reply["status"] == "interrupted"
        assert reply["content"].startswith(checkpointed) and WHOLE.startswith(reply["content"])
        assert reply["usage"]["estimated"] is True and reply["usage"]["output_tokens"] > 0
        assert conv["totals"]["turns"] == 1
        listed = httpx.get(f"{again.base_url}/api/conversations").json()
        assert [(c["id"], c["streaming"]) for c in listed] == [(conv_id, False)]

        sim.enqueue(Script(steps=[steps.Text("Back again.")]))
        answer = httpx.post(f"{again.base_url}/api/conversations/{conv_id}/messages",
                            json={"content": "go on"}, timeout=10)
        assert "event: done" in answer.text
        conv = httpx.get(f"{again.base_url}/api/conversations/{conv_id}").json()
        assert [(m["role"], m.get("status")) for m in conv["messages"]] == [
            ("user", None), ("assistant", "interrupted"), ("user", None), ("assistant", "complete")]


def test_a_comparison_cut_by_sigkill_leaves_every_reply_interrupted_after_restart(tmp_path, sim):
    """Each compared reply is checkpointed where it will be saved: the first model's on the path,
    the other's off it as its sibling. A crash leaves both, as far as each had come."""
    data_dir = tmp_path / "data"
    env = {"GATEWAY_BASE_URL": sim.base_url, "CHECKPOINT_SECONDS": "0.2"}
    models = ["openai/gpt-5-mini", "openai/gpt-5"]
    server = LiveServer(data_dir, env)
    try:
        for model in models:
            sim.enqueue_for(model, slow_reply(pause=0.1))
        conv_id = start_conversation(server.base_url)
        url = f"{server.base_url}/api/conversations/{conv_id}"
        post = Reader("POST", f"{url}/compare", json={"content": "tell me a long story", "models": models})
        post.wait_for(lambda events: len({data.get("assistant_message_id") for _, name, data in events
                                           if name == "delta"}) == 2)
        checkpoint = checkpoint_when(data_dir / "conversations" / f"{conv_id}.json",
                                     lambda c: c.message is not None and c.off_path, "no checkpoint holds both replies")
        first, [other] = checkpoint.message, checkpoint.off_path
        assert (first["model"], other["model"]) == tuple(models)
        assert {first["status"], other["status"]} == {"streaming"} and first["content"] and other["content"]
    finally:
        sigkilled(server)
    post.join()

    with restarted(data_dir, env, conv_id) as (again, conv):
        user, reply = conv["messages"]
        assert (reply["id"], reply["status"], reply["model"]) == (first["id"], "interrupted", models[0])
        assert reply["content"].startswith(first["content"]) and WHOLE.startswith(reply["content"])
        assert conv["branches"][reply["id"]] == [first["id"], other["id"]]
        assert conv["totals"]["turns"] == 2  # as the two saved replies would have counted
        # The other reply is there, one switch away, interrupted where the crash cut it.
        switched = httpx.post(f"{url.replace(server.base_url, again.base_url)}/branch",
                              json={"message_id": other["id"]}).json()
        sibling = switched["messages"][-1]
        assert (sibling["id"], sibling["status"], sibling["model"]) == (other["id"], "interrupted", models[1])
        assert sibling["content"].startswith(other["content"]) and WHOLE.startswith(sibling["content"])
        assert sibling["usage"]["estimated"] is True and sibling["usage"]["output_tokens"] > 0


# --- In-process: checkpoints, the stream route's answers, stalled readers ------------------------

@pytest.fixture
async def checkpointing(tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        upstream_timeout=5, checkpoint_seconds=0.05)
    async with serve(settings) as (app, client):
        yield client


async def wait_until(predicate, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while not (found := await predicate()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)
    return found


async def test_checkpoints_show_the_growing_reply_and_the_final_save_replaces_them(checkpointing, sim):
    client = checkpointing
    sim.enqueue(slow_reply())
    conv_id = (await client.post("/api/conversations", json={})).json()["id"]
    await client.patch(f"/api/conversations/{conv_id}", json={"settings": {"web_search": False, "web_fetch": False}})
    turn = asyncio.create_task(client.post(f"/api/conversations/{conv_id}/messages", json={"content": "go"}))

    async def checkpoint():
        conv = (await client.get(f"/api/conversations/{conv_id}")).json()
        last = conv["messages"][-1] if conv["messages"] else None
        return last if last and last["role"] == "assistant" and last["content"] else None

    partial = await wait_until(checkpoint)
    assert partial["status"] == "streaming" and WHOLE.startswith(partial["content"])
    assert partial["usage"]["estimated"] is True

    assert "event: done" in (await turn).text
    conv = (await client.get(f"/api/conversations/{conv_id}")).json()
    assert [(m["role"], m["content"], m.get("status")) for m in conv["messages"]] == [
        ("user", "go", None), ("assistant", WHOLE, "complete")]
    assert conv["messages"][1]["id"] == partial["id"] and conv["totals"]["turns"] == 1


async def test_stream_route_answers_204_404_and_refuses_a_bad_last_event_id(client, app):
    theirs = await app.state.chat.store.for_owner("someone-else").create(
        {"id": new_id(), "title": "theirs", "model": "m", "created_at": now_iso(), "updated_at": now_iso()})
    for method, path in (("GET", "stream"), ("POST", "stop")):
        answer = await client.request(method, f"/api/conversations/{theirs['id']}/{path}",
                                      json={} if method == "POST" else None)
        assert answer.status_code == 404, (method, path)
    conv_id = (await client.post("/api/conversations", json={})).json()["id"]
    assert (await client.get(f"/api/conversations/{conv_id}/stream")).status_code == 204
    assert (await client.get(f"/api/conversations/{conv_id}/stream?after=3")).status_code == 204
    assert (await client.get(f"/api/conversations/{'y' * 22}/stream")).status_code == 404
    bad = await client.get(f"/api/conversations/{conv_id}/stream", headers={"Last-Event-ID": "abc"})
    assert bad.status_code == 422 and "Last-Event-ID" in bad.json()["detail"]
    assert (await client.get(f"/api/conversations/{conv_id}/stream?after=-1")).status_code == 422
    assert (await client.post(f"/api/conversations/{conv_id}/stop", json={})).status_code == 204
    assert (await client.get(f"/api/conversations/{conv_id}")).json()["turn"] is None


async def call_with_stalled_reader(app, conv_id: str) -> tuple[asyncio.Task, asyncio.Event]:
    """POST a message straight into the ASGI app with a reader that takes the first frame, then no more."""
    body = orjson.dumps({"content": "go"})
    got_first = asyncio.Event()
    never = asyncio.Event()
    requested = False

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            if got_first.is_set():
                await never.wait()  # the reader stopped reading: the socket buffer is full
            got_first.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": f"/api/conversations/{conv_id}/messages", "raw_path": b"",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 80),
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())], "state": {}}
    call = asyncio.create_task(app(scope, receive, send))
    await asyncio.wait_for(got_first.wait(), 10)
    return call, got_first


@pytest.mark.parametrize("on_disconnect", ["continue", "stop"])
async def test_a_stalled_reader_never_holds_the_turn(tmp_path, sim, on_disconnect):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        upstream_timeout=5, on_disconnect=on_disconnect, stream_send_timeout=0.3)
    sim.enqueue(slow_reply(pause=0.02))
    async with serve(settings) as (app, client):
        conv_id = (await client.post("/api/conversations", json={})).json()["id"]
        await client.patch(f"/api/conversations/{conv_id}",
                           json={"settings": {"web_search": False, "web_fetch": False}})
        call, _ = await call_with_stalled_reader(app, conv_id)

        async def reply():
            conv = (await client.get(f"/api/conversations/{conv_id}")).json()
            return not conv["streaming"] and conv["messages"][-1]

        stored = await wait_until(reply)
        if on_disconnect == "continue":
            assert (stored["content"], stored["status"]) == (WHOLE, "complete")
            assert sim.requests[0].disconnected_at is None
        else:
            # The stalled send timed out, which is a hang-up: the turn stopped and kept what arrived.
            assert stored["status"] == "interrupted" and WHOLE.startswith(stored["content"])
            await asyncio.to_thread(sim.wait_for_disconnect, timeout=5)
        call.cancel()
        with contextlib.suppress(BaseException):
            await call


# --- The recovery rule in the file store: "streaming" with no turn lock held reads as interrupted ---

def with_checkpoint(conv: dict) -> dict:
    usage = {"input_tokens": 12, "output_tokens": 3, "cached_tokens": 0, "cache_write_tokens": 0,
             "cost": None, "searches": 0, "fetches": 0, "estimated": True}
    return {**conv, "messages": [
        {"id": new_id(), "role": "user", "content": "hi", "created_at": now_iso()},
        {"id": new_id(), "role": "assistant", "content": "Half a", "created_at": now_iso(), "model": "m",
         "status": "streaming", "activity": [], "citations": [], "usage": usage}]}


async def test_a_checkpoint_stays_streaming_while_its_lock_is_held_and_is_interrupted_once_it_is_not(tmp_path):
    files = FileStore(tmp_path / "data")
    mine = files.for_owner("local")
    conv = await mine.create({"id": new_id(), "title": "t", "model": "m", "created_at": now_iso(),
                              "updated_at": now_iso()})
    path = tmp_path / "data" / "conversations" / f"{conv['id']}.json"
    lock = await mine.lock_turn(conv["id"])
    # The turn's checkpoint lands on disk (written by the process that holds the lock).
    path.write_bytes(orjson.dumps(with_checkpoint(orjson.loads(path.read_bytes()))))

    assert (await mine.get(conv["id"]))["messages"][-1]["status"] == "streaming"
    assert (await mine.get(conv["id"]))["totals"]["turns"] == 0

    await mine.unlock_turn(lock)
    reply = (await mine.get(conv["id"]))["messages"][-1]
    assert (reply["status"], reply["content"], reply["usage"]["estimated"]) == ("interrupted", "Half a", True)
    assert (await mine.get(conv["id"]))["totals"]["turns"] == 1

    # A fresh process reads the same file the same way, and counts the reply once.
    again = FileStore(tmp_path / "data").for_owner("local")
    conv = await again.get(conv["id"])
    assert conv["messages"][-1]["status"] == "interrupted" and conv["totals"]["turns"] == 1
    assert (conv["totals"]["output_tokens"], conv["totals"]["cost_unreported"]) == (3, 1)
    # The next change writes the recovered reply to disk; reading it back changes nothing more.
    await again.update(conv["id"], lambda c: c.update(title="renamed"))
    stored = orjson.loads(path.read_bytes())
    assert stored["messages"][-1]["status"] == "interrupted" and stored["totals"]["turns"] == 1
    assert (await FileStore(tmp_path / "data").for_owner("local").get(conv["id"]))["totals"]["turns"] == 1


async def test_a_new_turn_settles_a_reply_a_dead_process_left_streaming_on_a_shared_store(redis_server, settings):
    """On Redis the lock the new turn holds is a lock held: only the turn's own opening change can
    tell that the reply left streaming is nobody's."""
    store = RedisStore(redis_server.url, prefix=unique_prefix())
    mine = store.for_owner("local")
    conv = await mine.create(with_checkpoint({"id": new_id(), "title": "t", "model": settings.default_model,
                                              "created_at": now_iso(), "updated_at": now_iso(), "settings": {}}))
    turns = Turns(settings, gateway=None)

    turn = await turns.begin(mine, conv["id"], "go on")
    await turn.opening
    await turns.release(turn)

    conv = await RedisStore(redis_server.url, prefix=store.prefix).for_owner("local").get(conv["id"])
    assert [(m["role"], m.get("status")) for m in conv["messages"]] == [
        ("user", None), ("assistant", "interrupted"), ("user", None)]
    assert conv["totals"]["turns"] == 1 and conv["messages"][1]["usage"]["estimated"] is True
    await store.close()


async def test_a_comparisons_checkpoints_on_a_shared_store_read_as_interrupted_once_nobody_holds_the_lock(redis_server):
    """On Redis too each compared reply is checkpointed where it will be saved, replaced in place as
    it grows, and read as interrupted, on the path and off it, once its turn's lock is gone."""
    store = RedisStore(redis_server.url, prefix=unique_prefix())
    mine = store.for_owner("local")
    user = {"id": new_id(), "role": "user", "content": "hi", "created_at": now_iso()}
    conv = await mine.create({"id": new_id(), "title": "t", "model": "m", "created_at": now_iso(),
                              "updated_at": now_iso(), "settings": {}, "messages": [user]})
    usage = {"input_tokens": 12, "output_tokens": 3, "cached_tokens": 0, "cache_write_tokens": 0,
             "cost": None, "searches": 0, "fetches": 0, "estimated": True}
    first, other = ({"id": new_id(), "role": "assistant", "content": "Half", "created_at": now_iso(), "model": model,
                     "parent_id": user["id"], "status": "streaming", "activity": [], "citations": [], "usage": usage}
                    for model in ("a", "b"))
    lock = await mine.lock_turn(conv["id"])
    await mine.checkpoint(conv["id"], first, off_path=[other], lock=lock)
    await mine.checkpoint(conv["id"], {**first, "content": "Half a reply"},
                          off_path=[{**other, "content": "Half another"}], lock=lock)
    held = await mine.get(conv["id"])
    assert [(m["id"], m["status"]) for m in held["messages"][1:] + held["off_path"]] == [
        (first["id"], "streaming"), (other["id"], "streaming")]
    await mine.unlock_turn(lock)  # as its process dying leaves it: nobody holds the conversation

    conv = await RedisStore(redis_server.url, prefix=store.prefix).for_owner("local").get(conv["id"])
    assert [(m["id"], m["status"], m["content"]) for m in conv["messages"][1:]] == [
        (first["id"], "interrupted", "Half a reply")]
    assert [(m["id"], m["status"], m["content"]) for m in conv["off_path"]] == [
        (other["id"], "interrupted", "Half another")]
    assert conv["totals"]["turns"] == 2
    # Recovered in the copy answered: what this process caches of Redis is left as Redis holds it.
    assert (await store.load(conv["id"], "local"))["off_path"][0]["status"] == "streaming"
    await store.close()
