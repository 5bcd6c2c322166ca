"""Reliability: killed processes, damaged files, many streams at once, and a gateway that misbehaves.

What is committed (the client saw `done`, or the 200/201/204 of a write) survives a SIGKILL;
a file the server cannot use never takes it down and is never written over; conversations
never see each other's messages; every upstream fault ends as kind `upstream` without losing
what the person typed.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import random
import secrets
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from chatserver.config import Settings
from chatserver.conversations.document import new_id
from gateway_sim.simulator import Script, errors, steps
from support import LiveServer, free_port, names, parse_sse, serve


async def new_conversation(client: httpx.AsyncClient, *, tools: bool = False) -> str:
    created = await client.post("/api/conversations", json={})
    assert created.status_code == 201, created.text
    conv_id = created.json()["id"]
    patched = await client.patch(f"/api/conversations/{conv_id}",
                                 json={"settings": {"web_search": tools, "web_fetch": tools,
                                                    **({} if tools else {"tools": []})}})
    assert patched.status_code == 200
    return conv_id


async def send(client: httpx.AsyncClient, conv_id: str, content: str) -> list[tuple[str, dict]]:
    response = await client.post(f"/api/conversations/{conv_id}/messages", json={"content": content})
    assert response.status_code == 200, response.text
    return parse_sse(response.text)


def alternates(messages: list[dict]) -> bool:
    roles = [m["role"] for m in messages if m["role"] != "notice"]
    return roles == ["user", "assistant"] * (len(roles) // 2)


# --- Crash consistency -------------------------------------------------------------------------

class Ledger:
    """What the clients were told is saved; the disk must hold at least this after any kill."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.turns: dict[str, list[tuple[str, str]]] = {}  # conv id -> [(user content, assistant id)]
        self.prompt: dict[str, int] = {}                    # conv id -> last acknowledged PATCH number
        self.memory = -1
        self.created: set[str] = set()
        self.deleted: set[str] = set()
        # Asked to be deleted: the server may have deleted it and been killed before answering.
        self.deleting: set[str] = set()
        self.writes = 0
        self.counts: collections.Counter[str] = collections.Counter()

    def wait_for_each(self, kinds: tuple[str, ...], since: dict[str, int], timeout: float) -> bool:
        """Block until each kind has a write acknowledged beyond `since`; False after `timeout` seconds."""
        with self.changed:
            return self.changed.wait_for(lambda: all(self.counts[k] > since.get(k, 0) for k in kinds), timeout)

    def commit(self, kind: str, *args) -> None:
        with self.lock:
            self.writes += 1
            self.counts[kind] += 1
            self.changed.notify_all()
            match kind:
                case "turn":
                    conv_id, content, assistant_id = args
                    self.turns.setdefault(conv_id, []).append((content, assistant_id))
                case "prompt":
                    conv_id, n = args
                    self.prompt[conv_id] = max(self.prompt.get(conv_id, -1), n)
                case "memory":
                    self.memory = max(self.memory, args[0])
                case "created":
                    self.created.add(args[0])
                case "deleted":
                    self.deleted.add(args[0])
                case "deleting":
                    self.deleting.add(args[0])


def turn_worker(base_url: str, conv_id: str, tag: str, counter, ledger: Ledger, stop: threading.Event) -> None:
    with httpx.Client(base_url=base_url, timeout=10) as http:
        while not stop.is_set():
            content = f"{tag}-{next(counter)}"
            try:
                with http.stream("POST", f"/api/conversations/{conv_id}/messages", json={"content": content}) as r:
                    body = "".join(r.iter_text())
            except httpx.HTTPError:
                return  # the server was killed under us
            events = parse_sse(body)
            if events and events[-1][0] == "done":
                ledger.commit("turn", conv_id, content, events[-1][1]["assistant_message_id"])


def patch_worker(base_url: str, conv_id: str, counter, ledger: Ledger, stop: threading.Event) -> None:
    with httpx.Client(base_url=base_url, timeout=10) as http:
        while not stop.is_set():
            n = next(counter)
            # A long persona makes every write of the file long, so kills land mid-write.
            try:
                if http.patch(f"/api/conversations/{conv_id}",
                              json={"settings": {"system_prompt": f"p-{n}-" + "x" * 20_000}}).status_code == 200:
                    ledger.commit("prompt", conv_id, n)
            except httpx.HTTPError:
                return


def misc_worker(base_url: str, counter, ledger: Ledger, stop: threading.Event) -> None:
    with httpx.Client(base_url=base_url, timeout=10) as http:
        while not stop.is_set():
            n = next(counter)
            try:
                memory = f"m-{n}\n" + "- a remembered fact\n" * 200
                if http.put("/api/memory", json={"text": memory}).status_code == 200:
                    ledger.commit("memory", n)
                created = http.post("/api/conversations", json={})
                if created.status_code == 201:
                    ledger.commit("created", created.json()["id"])
                    if n % 2:
                        ledger.commit("deleting", created.json()["id"])
                        if http.delete(f"/api/conversations/{created.json()['id']}").status_code == 204:
                            ledger.commit("deleted", created.json()["id"])
            except httpx.HTTPError:
                return


def check_disk(data_dir: Path, ledger: Ledger) -> None:
    """Every conversation file parses and holds everything acknowledged, in order."""
    conversations = data_dir / "conversations"
    stored = {}
    for path in conversations.iterdir():
        if path.name.endswith(".json"):
            conv = json.loads(path.read_bytes())  # never torn
            assert conv["id"] == path.stem
            stored[conv["id"]] = conv
    for conv_id, turns in ledger.turns.items():
        messages = stored[conv_id]["messages"]
        positions = {m["id"]: i for i, m in enumerate(messages)}
        users = {m["content"]: i for i, m in enumerate(messages) if m["role"] == "user"}
        last = -1
        for content, assistant_id in turns:
            assert content in users and assistant_id in positions, (conv_id, content)
            assert last < users[content] < positions[assistant_id], (conv_id, content)
            last = positions[assistant_id]
    for conv_id, n in ledger.prompt.items():
        assert int(stored[conv_id]["settings"]["system_prompt"].split("-")[1]) >= n
    if ledger.memory >= 0:
        assert int((data_dir / "memory.md").read_text().split("\n")[0][2:]) >= ledger.memory
    assert ledger.created - ledger.deleting <= set(stored)
    assert not ledger.deleted & set(stored)


def test_sigkill_during_turns_and_edits_never_loses_a_committed_write(tmp_path, sim):
    quick = Script(steps=[steps.Text("a quick reply in a few small chunks", chunk_size=2)], chunk_delay=0.003)
    sim.enqueue(*[quick] * 5000)
    data_dir = tmp_path / "data"
    env = {"GATEWAY_BASE_URL": sim.base_url}
    ledger = Ledger()
    counter = iter(range(10**9)).__next__
    lock = threading.Lock()

    def numbers():
        while True:
            with lock:
                yield counter()

    server = LiveServer(data_dir, env)
    with httpx.Client(base_url=server.base_url) as http:
        conv_ids = []
        for _ in range(3):
            conv_id = http.post("/api/conversations", json={}).json()["id"]
            http.patch(f"/api/conversations/{conv_id}", json={"settings": {"web_search": False, "web_fetch": False}})
            conv_ids.append(conv_id)
    rounds = 8
    try:
        for round_ in range(rounds):
            if round_:
                server = LiveServer(data_dir, env)
                # Restarted on what the killed one left: every conversation opens.
                listing = httpx.get(f"{server.base_url}/api/conversations").json()
                assert {c["id"] for c in listing} >= set(conv_ids)
                for conv_id in conv_ids:
                    assert httpx.get(f"{server.base_url}/api/conversations/{conv_id}").status_code == 200
            stop = threading.Event()
            workers = [threading.Thread(target=turn_worker, args=(server.base_url, conv_id, f"r{round_}c{i}",
                                                                  iter(numbers()), ledger, stop))
                       for i, conv_id in enumerate(conv_ids)]
            workers += [threading.Thread(target=patch_worker, args=(server.base_url, conv_id, numbers(), ledger, stop))
                        for conv_id in conv_ids]
            workers.append(threading.Thread(target=misc_worker, args=(server.base_url, numbers(), ledger, stop)))
            before = dict(ledger.counts)
            for worker in workers:
                worker.start()
            # Killed once every kind of write was acknowledged this round, not after a fixed sleep:
            # on a busy machine nothing may be acknowledged by then. The other writers are mid-way.
            acknowledged = ledger.wait_for_each(("turn", "prompt", "memory"), before, timeout=30)
            os.kill(server.process.pid, signal.SIGKILL)
            server.process.wait()
            server._log.close()
            stop.set()
            for worker in workers:
                worker.join(15)
            assert acknowledged, f"not every kind of write was acknowledged within 30 s: {ledger.counts}"
            check_disk(data_dir, ledger)
    finally:
        if server.process.poll() is None:
            server.stop()
    assert all(ledger.turns.get(c) for c in conv_ids) and ledger.memory >= 0 and ledger.prompt


# --- Damaged and foreign files -----------------------------------------------------------------

def damaged_files(good: dict) -> dict[str, tuple[str, bytes | None, str]]:
    """name -> (conversation id, content or None for a directory, a word the 409 must use)."""
    def conv_json(conv_id: str, **fields) -> bytes:
        return json.dumps({**good, "id": conv_id, **fields}).encode()

    ids = {name: new_id() for name in ("truncated", "array", "binary", "mismatch", "future", "types", "stamp",
                                       "dir", "empty", "null")}
    return {
        "truncated": (ids["truncated"], conv_json(ids["truncated"])[:-40], "damaged"),
        "array": (ids["array"], b"[1, 2, 3]", "not a conversation"),
        "binary": (ids["binary"], bytes(range(256)) * 8, "damaged"),
        # A copy of the good conversation under another name: writing it would clobber the original's id.
        "mismatch": (ids["mismatch"], json.dumps(good).encode(), "id"),
        "future": (ids["future"], conv_json(ids["future"], schema_version=99), "schema_version"),
        "types": (ids["types"], conv_json(ids["types"], messages="oops"), "messages"),
        # Sorting the listing by a number among strings would fail every listing.
        "stamp": (ids["stamp"], conv_json(ids["stamp"], updated_at=5), "updated_at"),
        "dir": (ids["dir"], None, "directory"),
        "empty": (ids["empty"], b"", "damaged"),
        "null": (ids["null"], b"null", "not a conversation"),
    }


def fingerprint(path: Path) -> object:
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else path.read_bytes()


async def test_damaged_or_foreign_files_are_skipped_reported_and_never_overwritten(client, settings, sim, caplog):
    caplog.set_level(logging.WARNING)
    good_id = await new_conversation(client)
    sim.enqueue(Script(steps=[steps.Text("Fine.")]))
    assert names(await send(client, good_id, "hello"))[-1] == "done"
    conversations = settings.data_dir / "conversations"
    good_path = conversations / f"{good_id}.json"
    good = json.loads(good_path.read_bytes())

    bad = damaged_files(good)
    for conv_id, content, _ in bad.values():
        path = conversations / f"{conv_id}.json"
        if content is None:
            path.mkdir()
            (path / "inside.txt").write_text("not mine")
        else:
            path.write_bytes(content)
    (conversations / "notes.json").write_text(json.dumps({**good, "id": "notes"}))
    (conversations / "x.json").mkdir()
    foreign = ["notes.json", "x.json"]
    before = {p.name: fingerprint(p) for p in conversations.iterdir()}
    requests_before = len(sim.requests)

    listing = await client.get("/api/conversations")

    assert listing.status_code == 200
    assert [c["id"] for c in listing.json()] == [good_id]
    for name in [f"{conv_id}.json" for conv_id, _, _ in bad.values()] + foreign:
        assert name in caplog.text, name

    for case, (conv_id, _, word) in bad.items():
        response = await client.get(f"/api/conversations/{conv_id}")
        assert response.status_code == 409, (case, response.status_code)
        assert word in response.json()["detail"], (case, response.json())
        base = f"/api/conversations/{conv_id}"
        for method, path, body in [("PATCH", base, {"title": "overwrite?"}), ("POST", f"{base}/messages",
                                   {"content": "overwrite?"}), ("POST", f"{base}/regenerate", {}),
                                   ("POST", f"{base}/rewind", {}), ("POST", f"{base}/compress", {}),
                                   ("DELETE", base, None)]:
            response = await client.request(method, path, json=body)
            assert response.status_code == 409, (case, method, path, response.status_code)
        # The damage is logged with the file's name.
        assert f"{conv_id}.json" in caplog.text
    for name in ("notes", "x"):
        assert (await client.get(f"/api/conversations/{name}")).status_code in (404, 422)

    assert {p.name: fingerprint(p) for p in conversations.iterdir()} == before
    assert len(sim.requests) == requests_before
    assert not [p for p in conversations.iterdir() if p.name.endswith(".tmp")]

    # The rest keeps working.
    sim.enqueue(Script(steps=[steps.Text("Still fine.")]))
    assert names(await send(client, good_id, "still there?"))[-1] == "done"
    fresh = await new_conversation(client)
    listing = (await client.get("/api/conversations")).json()
    assert {c["id"] for c in listing} == {good_id, fresh}
    assert [m["content"] for m in (await client.get(f"/api/conversations/{good_id}")).json()["messages"]] == [
        "hello", "Fine.", "still there?", "Still fine."]


@pytest.mark.parametrize("memory,models", [
    (b"\xff\xfe\x00 not utf-8 \xc3", b"5"),
    (b"- fine memory\n", b'{"id": "not a list"}'),
    (b"- fine memory\n", b"[1, \"two\", null, {\"tier\": \"fast\"}]"),
    (b"- fine memory\n", b"[{\"id\": \"x/y\", \"tier\""),
])
async def test_damaged_memory_or_models_file_never_takes_the_server_down(client, settings, sim, memory, models):
    conv_id = await new_conversation(client)
    (settings.data_dir / "memory.md").write_bytes(memory)
    (settings.data_dir / "models.json").write_bytes(models)

    assert (await client.get("/api/memory")).status_code == 200
    lineup = await client.get("/api/models")
    assert lineup.status_code == 200 and sum(len(t["models"]) for t in lineup.json()["tiers"]) == 7
    assert (await client.get(f"/api/conversations/{conv_id}")).status_code == 200
    sim.enqueue(Script(steps=[steps.Text("Answered anyway.")]))
    assert names(await send(client, conv_id, "hello"))[-1] == "done"


# --- Concurrency -------------------------------------------------------------------------------

async def test_fifty_conversations_streaming_at_once_keep_their_messages_apart(client, sim):
    # Unscripted requests get the demo reply, which quotes the request's own last user message
    # (chat) or searches for it (tools): every reply carries the marker of the request it answers.
    markers = [f"mk{i:02d}{secrets.token_hex(4)}" for i in range(50)]
    conv_ids = await asyncio.gather(*[new_conversation(client, tools=i % 2 == 1) for i in range(50)])

    results = await asyncio.gather(*[send(client, conv_id, f"{marker} please answer")
                                     for conv_id, marker in zip(conv_ids, markers)])

    for i, (conv_id, marker, events) in enumerate(zip(conv_ids, markers, results)):
        assert names(events)[0] == "start" and names(events)[-1] == "done", (i, names(events))
        conv = (await client.get(f"/api/conversations/{conv_id}")).json()
        user, reply = conv["messages"]
        assert user["content"] == f"{marker} please answer"
        assert reply["role"] == "assistant" and reply["status"] == "complete"
        streamed = json.dumps(events)
        others = [m for m in markers if m != marker]
        assert not any(m in streamed or m in json.dumps(conv) for m in others), i
        if i % 2:
            assert marker in json.dumps(reply["activity"]) and marker in json.dumps(reply["citations"])
        else:
            assert marker in reply["content"]
    asked = []
    for request in sim.requests:
        last_user = [m for m in request.body["messages"] if m["role"] == "user"][-1]
        found = [m for m in markers if m in json.dumps(last_user)]
        assert len(found) == 1
        asked += found
    assert sorted(asked) == sorted(markers)


async def test_racing_requests_on_one_conversation_never_interleave(client, sim):
    conv_id = await new_conversation(client)
    slow = Script(steps=[steps.Text("part one, "), steps.Sleep(0.15), steps.Text("part two")])
    sim.enqueue(*[slow] * 40)
    rng = random.Random(6)
    base = f"/api/conversations/{conv_id}"
    for round_ in range(6):
        calls = ([("messages", {"content": f"r{round_} q{i}"}) for i in range(4)]
                 + [("regenerate", {}), ("regenerate", {}), ("rewind", {}), ("compress", {})])
        rng.shuffle(calls)

        responses = await asyncio.gather(*[client.post(f"{base}/{path}", json=body) for path, body in calls])

        streams = [r for (path, _), r in zip(calls, responses) if path in ("messages", "regenerate")]
        assert all(r.status_code in (200, 409) for r in responses), [r.status_code for r in responses]
        winners = [r for r in streams if r.status_code == 200]
        assert len(winners) <= 1
        for r in winners:
            assert names(parse_sse(r.text))[-1] == "done"
        conv = (await client.get(base)).json()
        assert not conv["streaming"]
        assert alternates(conv["messages"]), [(m["role"], m["content"]) for m in conv["messages"]]
        # Only one question at a time was ever answered: each reply follows the question it answered.
        for request in sim.requests:
            sent = [m for m in request.body.get("messages", []) if m["role"] in ("user", "assistant")]
            assert [m["role"] for m in sent][-1:] == ["user"]


async def test_first_of_simultaneous_sends_wins_the_rest_are_409(client, sim):
    conv_id = await new_conversation(client)
    sim.enqueue(Script(steps=[steps.Text("only "), steps.Sleep(0.2), steps.Text("answer")]))

    responses = await asyncio.gather(*[client.post(f"/api/conversations/{conv_id}/messages",
                                                   json={"content": f"q{i}"}) for i in range(10)])

    assert sorted(r.status_code for r in responses) == [200] + [409] * 9
    winner = next(i for i, r in enumerate(responses) if r.status_code == 200)
    messages = (await client.get(f"/api/conversations/{conv_id}")).json()["messages"]
    assert [(m["role"], m["content"]) for m in messages] == [("user", f"q{winner}"), ("assistant", "only answer")]
    assert len(sim.requests) == 1


async def test_patch_during_a_stream_is_kept_and_delete_stays_deleted(client, sim, settings):
    kept = await new_conversation(client)
    gone = await new_conversation(client)
    sim.enqueue(Script(steps=[steps.Text("one "), steps.Sleep(0.4), steps.Text("two")]),
                Script(steps=[steps.Text("one "), steps.Sleep(0.4), steps.Text("two")]))
    first = asyncio.create_task(send(client, kept, "question"))
    second = asyncio.create_task(send(client, gone, "question"))
    await asyncio.to_thread(sim.wait_for_requests, 2)

    patched = await client.patch(f"/api/conversations/{kept}", json={"title": "renamed mid-stream",
                                                                     "settings": {"system_prompt": "new persona"}})
    deleted = await client.delete(f"/api/conversations/{gone}")
    assert patched.status_code == 200 and deleted.status_code == 204
    await first
    await second

    conv = (await client.get(f"/api/conversations/{kept}")).json()
    assert conv["title"] == "renamed mid-stream" and conv["settings"]["system_prompt"] == "new persona"
    assert [m["content"] for m in conv["messages"]] == ["question", "one two"]
    assert (await client.get(f"/api/conversations/{gone}")).status_code == 404
    assert not (settings.data_dir / "conversations" / f"{gone}.json").exists()
    assert gone not in [c["id"] for c in (await client.get("/api/conversations")).json()]


# --- Upstream faults ---------------------------------------------------------------------------

TIMEOUT = 1.0
SLOW = 8.0  # how long a hanging gateway would take; every fault must end well before this

FAULTS = {
    "html 502 from a proxy": (errors.proxy_502_html(), ""),
    "malformed json": (Script(steps=[steps.Raw(b"data: {not json\n\n")]), ""),
    "malformed json after text": (Script(steps=[steps.Text("Partial answer"), steps.Raw(b"data: {not json\n\n")]),
                                  "Partial answer"),
    "json that is not an object": (Script(steps=[steps.Raw(b"data: [1, 2]\n\n")]), ""),
    "chunk of the wrong shape": (Script(steps=[steps.Raw(b'data: {"choices": "nope", "delta": 5}\n\n'),
                                               steps.Raw(b'data: {"type": "content_block_start", "index": 0, '
                                                         b'"content_block": "nope"}\n\n')]), ""),
    "html instead of events": (Script(steps=[steps.Raw(b"<html><body>Service Unavailable</body></html>\n"),
                                             steps.Close()]), ""),
    "closed before anything": (Script(steps=[steps.Close()]), ""),
    "closed after text": (Script(steps=[steps.Text("Partial answer"), steps.Close()]), "Partial answer"),
    "connection reset after text": (Script(steps=[steps.Text("Partial answer"), steps.Close(reset=True)]),
                                    "Partial answer"),
    "connection reset before text": (Script(steps=[steps.Close(reset=True)]), ""),
    "hangs before the first byte": (Script(steps=[steps.Text("too late")], first_byte_delay=SLOW), ""),
    "stalls before the first event": (Script(steps=[steps.Sleep(SLOW), steps.Text("too late")]), ""),
    "stalls mid-stream": (Script(steps=[steps.Text("Partial answer"), steps.Sleep(SLOW), steps.Text("late")]),
                          "Partial answer"),
}


@pytest.fixture
async def impatient(tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        upstream_timeout=TIMEOUT)
    async with serve(settings) as (app, client):
        yield client


async def assert_fault_handled(client, sim, conv_id: str, events, partial: str, content: str) -> None:
    assert names(events)[0] == "start" and names(events)[-1] == "error", names(events)
    error = events[-1][1]
    assert error["kind"] == "upstream" and error["retryable"] is True, error
    assert error["message"]
    conv = (await client.get(f"/api/conversations/{conv_id}")).json()
    assert conv["streaming"] is False
    if partial:
        assert error["partial"] is True and "draft" not in error
        assert [(m["role"], m["content"], m.get("status")) for m in conv["messages"]] == [
            ("user", content, None), ("assistant", partial, "interrupted")]
    else:
        assert error["partial"] is False and error["draft"] == content
        assert conv["messages"] == []
    # Nothing is stuck: the next turn runs.
    sim.reset()
    sim.enqueue(Script(steps=[steps.Text("Recovered.")]))
    assert names(await send(client, conv_id, "try again"))[-1] == "done"


@pytest.mark.parametrize("transport", ["chat", "tools"])
@pytest.mark.parametrize("fault", list(FAULTS))
async def test_upstream_fault_ends_as_upstream_failure_within_the_timeout(impatient, sim, fault, transport):
    script, partial = FAULTS[fault]
    conv_id = await new_conversation(impatient, tools=transport == "tools")
    sim.enqueue(script)
    started = time.monotonic()

    events = await send(impatient, conv_id, "my precious words")

    assert time.monotonic() - started < SLOW - 2, "the turn waited for the gateway instead of timing out"
    expected_path = "/v1/messages" if transport == "tools" else "/v1/chat/completions"
    assert sim.requests[0].path == expected_path
    await assert_fault_handled(impatient, sim, conv_id, events, partial, "my precious words")


@pytest.mark.parametrize("transport", ["chat", "tools"])
async def test_gateway_refusing_connections_is_an_upstream_failure(tmp_path, transport):
    closed = free_port()
    settings = Settings(_env_file=None, gateway_base_url=f"http://127.0.0.1:{closed}",
                        data_dir=tmp_path / "data", upstream_timeout=TIMEOUT)
    async with serve(settings) as (_, client):
        conv_id = await new_conversation(client, tools=transport == "tools")
        events = await send(client, conv_id, "anyone there?")
        assert names(events) == ["start", "error"]
        error = events[-1][1]
        assert (error["kind"], error["partial"], error["draft"]) == ("upstream", False, "anyone there?")
        conv = (await client.get(f"/api/conversations/{conv_id}")).json()
        assert conv["messages"] == [] and conv["streaming"] is False
