"""Several server processes on one Redis (STORE=redis): what one makes, the other lists, reads and
continues; a turn running on one is 409 on the other, stopped and re-attached from the other, and
recovered by the other when its process dies; ownership holds the same on both."""

from __future__ import annotations

import contextlib
import itertools
import signal
import sqlite3
import threading
import time

import httpx
import pytest

from gateway_sim.simulator import Script, steps
from redis_support import RedisServer
from support import LiveServer, hang_up_after_first_delta, parse_sse
from test_answers import MODELS as COMPARED
from test_auth import A_PASSWORD, B_PASSWORD
from test_reattach import (
    WHOLE,
    Reader,
    assert_running,
    has_delta,
    settled,
    slow_reply,
    start_conversation,
    text_of,
)
from test_shared_accounts import add_users

_databases = itertools.count(1)


def two_servers(tmp_path, sim, redis_server, **extra: str) -> tuple[LiveServer, LiveServer]:
    """Two servers on one Redis database of their own, each with its own (unused) data directory."""
    env = {"GATEWAY_BASE_URL": sim.base_url, "STORE": "redis",
           "REDIS_URL": f"redis://127.0.0.1:{redis_server.port}/{next(_databases) % 16}", **extra}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    first = LiveServer(tmp_path / "a" / "data", env)
    try:
        return first, LiveServer(tmp_path / "b" / "data", env)
    except BaseException:
        first.stop()
        raise


@pytest.fixture
def pair(tmp_path, sim, redis_server):
    first, second = two_servers(tmp_path, sim, redis_server)
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


def test_each_server_finds_what_the_other_wrote_and_forgets_what_it_deleted(pair, sim):
    a, b = pair
    sim.enqueue(Script(steps=[steps.Text("Aubergine is 가지 in Korean.")]),
                Script(steps=[steps.Text("Cucumber is 오이.")]))
    kept = httpx.post(f"{a.base_url}/api/conversations", json={}).json()
    gone = httpx.post(f"{a.base_url}/api/conversations", json={}).json()
    for conv, question in ((kept, "what is aubergine"), (gone, "what is cucumber")):
        assert "event: done" in httpx.post(f"{b.base_url}/api/conversations/{conv['id']}/messages",
                                           json={"content": question}, timeout=10).text

    def found(server, q: str) -> set[str]:
        """The conversations of the hits (a question and its answer may both match)."""
        answer = httpx.get(f"{server.base_url}/api/search", params={"q": q})
        assert answer.status_code == 200, answer.text
        return {hit["conversation_id"] for hit in answer.json()}

    def finds(server, q: str, expected: set[str]) -> None:
        """Each index follows the other server's changes within moments, not on the search's path."""
        deadline = time.monotonic() + 10
        while (hits := found(server, q)) != expected:
            assert time.monotonic() < deadline, (q, hits, expected)
            time.sleep(0.05)

    finds(a, "가지", {kept["id"]})
    finds(a, "cucumber", {gone["id"]})
    httpx.patch(f"{b.base_url}/api/conversations/{kept['id']}", json={"title": "Vegetables 채소"})
    assert httpx.delete(f"{b.base_url}/api/conversations/{gone['id']}").status_code == 204

    finds(a, "채소", {kept["id"]})
    finds(a, "cucumber", set())
    finds(b, "aubergine", {kept["id"]})


def indexed_texts(server: LiveServer) -> set[str]:
    """What the server's own search index holds now, read from its file (no search asked of it)."""
    path = server.data_dir / "index" / "search-redis.sqlite3"
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        return {text for (text,) in db.execute("SELECT text FROM docs")}


def test_each_servers_index_follows_the_others_changes_without_being_searched(pair, sim):
    """Search followed Redis only on the request path: each search first re-read the person's
    changed conversations. Now every process's index follows the store's change feed."""
    a, b = pair
    sim.enqueue(Script(steps=[steps.Text("Parsnips keep well in sand.")]))
    conv = httpx.post(f"{a.base_url}/api/conversations", json={}).json()
    assert "event: done" in httpx.post(f"{a.base_url}/api/conversations/{conv['id']}/messages",
                                       json={"content": "how do I store parsnips"}, timeout=10).text
    deadline = time.monotonic() + 10
    while "Parsnips keep well in sand." not in indexed_texts(b):
        assert time.monotonic() < deadline, "B's index never heard of A's reply"
        time.sleep(0.05)
    assert httpx.delete(f"{a.base_url}/api/conversations/{conv['id']}").status_code == 204
    while indexed_texts(b):
        assert time.monotonic() < deadline, "B's index kept a conversation A deleted"
        time.sleep(0.05)


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


def test_ownership_holds_the_same_on_both_servers(tmp_path, sim, redis_server):
    database = f"redis://127.0.0.1:{redis_server.port}/{next(_databases) % 16}"
    add_users(database, ("alice", A_PASSWORD, True), ("bob", B_PASSWORD, False))  # in Redis: one bob for both
    servers = []
    for name in ("a", "b"):
        data_dir = tmp_path / name / "data"
        data_dir.parent.mkdir()
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

            # A turn of Alice's running on A is no more Bob's on B: he can neither follow nor stop it.
            sim.enqueue(slow_reply())
            url = f"/api/conversations/{conv['id']}"
            post = Reader("POST", f"{a.base_url}{url}/messages", json={"content": "mine"},
                          cookies=dict(alice.cookies))
            post.wait_for(has_delta)
            assert alice_on_b.get(url).json()["turn"] is not None
            assert bob.get(f"{url}/stream", headers={"Last-Event-ID": "1"}).status_code == 404
            assert bob.post(f"{url}/stop", json={}).status_code == 404
            events = post.join()
            assert events[-1][1] == "done" and events[-1][2]["status"] == "complete"
            assert text_of(events) == WHOLE
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
    for answer in (down, turn):  # where the store lives is for the log, not for whoever asked
        assert str(redis.port) not in answer.text and "127.0.0.1" not in answer.text
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
    assert str(redis.port) not in error["message"]
    assert parse_sse(again)[-1][0] == "done"


def test_a_turn_longer_than_the_lock_expiry_keeps_its_lock_by_renewing_it(tmp_path, sim, redis_server):
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


def test_stop_on_one_server_stops_the_turn_where_it_runs(tmp_path, sim, redis_server):
    a, b = two_servers(tmp_path, sim, redis_server)
    try:
        sim.enqueue(slow_reply())
        conv_id = start_conversation(a.base_url)
        on_a, on_b = f"{a.base_url}/api/conversations/{conv_id}", f"{b.base_url}/api/conversations/{conv_id}"
        post = Reader("POST", f"{on_a}/messages", json={"content": "tell me a long story"})
        post.wait_for(has_delta)
        follower = Reader("GET", f"{on_b}/stream", headers={"Last-Event-ID": "1"})
        follower.wait_for(has_delta)
        assert_running(on_b, post)

        asked = time.monotonic()
        assert httpx.post(f"{on_b}/stop", json={}, timeout=20).status_code == 204
        answered = time.monotonic()
        after = httpx.get(on_b).json()  # the stop answers once the reply is saved and the turn let go

        record = sim.wait_for_disconnect(timeout=5)
        assert not record.completed, "A's upstream call went on after Stop on B"
        events = post.join()
        assert events[-1][1] == "done" and events[-1][2]["status"] == "interrupted"
        assert events[-1][2]["usage"]["estimated"] is True
        assert follower.join() == events[1:], "B's follower got every event after 1, once, to the same end"
        assert answered - asked < 10
        assert after["streaming"] is False and after["turn"] is None
        replies = [m for m in after["messages"] if m["role"] == "assistant"]
        assert [(m["content"], m["status"]) for m in replies] == [(text_of(events), "interrupted")]
        assert replies[0]["content"] != WHOLE and after["totals"]["turns"] == 1
        assert httpx.post(f"{on_b}/stop", json={}).status_code == 204, "nothing runs: still 204"
    finally:
        a.stop()
        b.stop()


def test_one_reply_of_a_comparison_on_one_server_is_stopped_through_the_other(tmp_path, sim, redis_server):
    """Stop on one reply reached only the process running the comparison: elsewhere it was 409."""
    a, b = two_servers(tmp_path, sim, redis_server)
    release = threading.Event()
    try:
        for i, model in enumerate(COMPARED):
            sim.enqueue_for(model, Script(steps=[steps.Text(f"reply {i} begins. "), steps.Hold(release),
                                                 steps.Text(f"reply {i} ends.")]))
        conv_id = start_conversation(a.base_url)
        on_a, on_b = f"{a.base_url}/api/conversations/{conv_id}", f"{b.base_url}/api/conversations/{conv_id}"
        post = Reader("POST", f"{on_a}/compare", json={"content": "which is best?", "models": COMPARED})
        post.wait_for(lambda events: events and events[0][1] == "start")
        ids = [r["assistant_message_id"] for r in post.events[0][2]["compare"]]
        post.wait_for(lambda events: {d["assistant_message_id"] for _, name, d in events if name == "delta"} == set(ids))
        requests = {r.body["model"]: r for r in sim.requests if r.body.get("stream")}

        stopped = httpx.post(f"{on_b}/stop", json={"assistant_message_id": ids[1]}, timeout=20)
        assert stopped.status_code == 204, stopped.text
        sim.wait_for_disconnect(list(sim.requests).index(requests[COMPARED[1]]), timeout=10)
        assert requests[COMPARED[0]].disconnected_at is None and requests[COMPARED[2]].disconnected_at is None
        assert not post.finished.is_set(), "the other two replies are still streaming"
        post.wait_for(lambda events: any(name == "done" and d["assistant_message_id"] == ids[1] for _, name, d in events))
        release.set()

        events = post.join()
        ends = {d["assistant_message_id"]: d["status"] for _, name, d in events[:-1] if name == "done"}
        assert ends == {ids[0]: "complete", ids[1]: "interrupted", ids[2]: "complete"}
        assert events[-1][1] == "done" and events[-1][2]["assistant_message_id"] is None
        settled(b.base_url, conv_id)
        shown = httpx.post(f"{on_b}/branch", json={"message_id": ids[1]}).json()["messages"][-1]
        assert (shown["content"], shown["status"]) == ("reply 1 begins. ", "interrupted")
        assert httpx.post(f"{on_b}/stop", json={"assistant_message_id": ids[1]}).status_code == 204, \
            "nothing runs: still 204"
    finally:
        release.set()
        a.stop()
        b.stop()


def test_a_lone_turns_reply_stopped_by_its_id_through_the_other_server_stops_the_turn(pair, sim):
    a, b = pair
    sim.enqueue(slow_reply())
    conv_id = start_conversation(a.base_url)
    post = Reader("POST", f"{a.base_url}/api/conversations/{conv_id}/messages", json={"content": "a long story"})
    post.wait_for(has_delta)
    reply_id = post.events[0][2]["assistant_message_id"]

    on_b = f"{b.base_url}/api/conversations/{conv_id}"
    assert httpx.post(f"{on_b}/stop", json={"assistant_message_id": reply_id}, timeout=20).status_code == 204
    after = httpx.get(on_b).json()  # answered once the reply is saved and the turn let go
    assert not sim.wait_for_disconnect(timeout=5).completed
    assert post.join()[-1][2]["status"] == "interrupted"
    assert after["turn"] is None and after["messages"][-1]["status"] == "interrupted"


def test_reattach_on_one_server_gets_every_event_of_the_turn_on_the_other_once(tmp_path, sim, redis_server):
    a, b = two_servers(tmp_path, sim, redis_server)
    try:
        sim.enqueue(slow_reply())
        conv_id = start_conversation(a.base_url)
        hang_up_after_first_delta(a.base_url, conv_id)
        rest = Reader("GET", f"{b.base_url}/api/conversations/{conv_id}/stream",
                      headers={"Last-Event-ID": "1"}).join()

        assert sim.wait_for_requests(1)[0].disconnected_at is None
        assert [seq for seq, _, _ in rest] == list(range(2, 2 + len(rest))), "every later event, once, in order"
        assert rest[-1][1] == "done" and rest[-1][2]["status"] == "complete"
        assert text_of(rest) == WHOLE
        stored = httpx.get(f"{b.base_url}/api/conversations/{conv_id}").json()
        assert stored["streaming"] is False and stored["turn"] is None
        assert [(m["content"], m["status"]) for m in stored["messages"] if m["role"] == "assistant"] == [
            (WHOLE, "complete")]
        # Replayed from Redis after the end too, on either server; nothing after the last id.
        again = Reader("GET", f"{b.base_url}/api/conversations/{conv_id}/stream?after=1").join()
        assert again == rest
        assert httpx.get(f"{a.base_url}/api/conversations/{conv_id}/stream",
                         headers={"Last-Event-ID": str(rest[-1][0])}).status_code == 204
    finally:
        a.stop()
        b.stop()


def test_a_server_killed_mid_turn_leaves_the_reply_interrupted_for_the_other(tmp_path, sim, redis_server):
    lock_seconds = 1.0
    a, b = two_servers(tmp_path, sim, redis_server, TURN_LOCK_SECONDS=str(lock_seconds), CHECKPOINT_SECONDS="0.2")
    try:
        sim.enqueue(slow_reply(pause=0.1))
        conv_id = start_conversation(a.base_url)
        on_b = f"{b.base_url}/api/conversations/{conv_id}"
        post = Reader("POST", f"{a.base_url}/api/conversations/{conv_id}/messages",
                      json={"content": "tell me a long story"})
        post.wait_for(lambda events: len(text_of(events)) > len("piece0 piece1 "))
        deadline = time.monotonic() + 10
        while True:  # B reads A's checkpoint from Redis
            seen = httpx.get(on_b).json()
            if seen["messages"][-1]["role"] == "assistant" and seen["messages"][-1]["content"]:
                break
            assert time.monotonic() < deadline, "no checkpoint reached Redis"
            time.sleep(0.02)
        assert seen["streaming"] is True and seen["messages"][-1]["status"] == "streaming"
        checkpointed = seen["messages"][-1]["content"]
        a.process.kill()
        a.process.wait(10)
        killed = time.monotonic()

        while True:
            conv = httpx.get(on_b).json()
            if conv["messages"][-1]["status"] == "interrupted":
                break
            assert time.monotonic() - killed < lock_seconds + 3, "the dead turn's reply stayed streaming"
            time.sleep(0.02)
        recovered_after = time.monotonic() - killed
        assert conv["streaming"] is False and conv["turn"] is None
        user, reply = conv["messages"]
        assert reply["content"].startswith(checkpointed) and WHOLE.startswith(reply["content"])
        assert reply["usage"]["estimated"] is True and reply["usage"]["output_tokens"] > 0
        assert conv["totals"]["turns"] == 1
        assert [(c["id"], c["streaming"]) for c in httpx.get(f"{b.base_url}/api/conversations").json()] == [
            (conv_id, False)]

        sim.enqueue(Script(steps=[steps.Text("Back again.")]))
        answer = httpx.post(f"{on_b}/messages", json={"content": "go on"}, timeout=10)
        assert parse_sse(answer.text)[-1][0] == "done"
        conv = httpx.get(on_b).json()
        assert [(m["role"], m.get("status")) for m in conv["messages"]] == [
            ("user", None), ("assistant", "interrupted"), ("user", None), ("assistant", "complete")]
        assert conv["totals"]["turns"] == 2
        assert recovered_after < lock_seconds + 3
    finally:
        a.stop()
        b.stop()
    post.join()


def is_checkpoint(message: dict) -> bool:
    return message["role"] == "assistant" and message.get("status") == "streaming" and bool(message["content"])


def test_a_server_killed_mid_reply_is_noticed_by_the_other_within_a_few_heartbeats(tmp_path, sim, redis_server):
    """Killing the server running a reply left the other's follower frozen until the 30 s lock expired."""
    a, b = two_servers(tmp_path, sim, redis_server, HEARTBEAT_SECONDS="0.5",  # TURN_LOCK_SECONDS stays 30
                       CHECKPOINT_SECONDS="0.2")
    try:
        sim.enqueue(slow_reply(pause=0.5))  # twenty seconds of reply: the kill lands mid-reply
        conv_id = start_conversation(a.base_url)
        on_b = f"{b.base_url}/api/conversations/{conv_id}"
        post = Reader("POST", f"{a.base_url}/api/conversations/{conv_id}/messages", json={"content": "go slowly"})
        post.wait_for(has_delta)
        follower = Reader("GET", f"{on_b}/stream", headers={"Last-Event-ID": "1"})
        follower.wait_for(has_delta)
        deadline = time.monotonic() + 10
        # A's checkpoint is in Redis: the reply, not only the question, is the last message.
        while not is_checkpoint(httpx.get(on_b).json()["messages"][-1]):
            assert time.monotonic() < deadline, "no checkpoint reached Redis"
            time.sleep(0.02)
        assert [c["streaming"] for c in httpx.get(f"{b.base_url}/api/conversations").json()] == [True]

        a.process.kill()
        a.process.wait(10)
        killed = time.monotonic()
        assert follower.finished.wait(10), "B's follower never learned that A stopped answering"
        noticed_after = time.monotonic() - killed
        events = follower.join()
        asked = time.monotonic()
        stop = httpx.post(f"{on_b}/stop", json={}, timeout=20)
        stop_took = time.monotonic() - asked
        listed = httpx.get(f"{b.base_url}/api/conversations").json()
        conv = httpx.get(on_b).json()
        sim.enqueue(Script(steps=[steps.Text("Back again.")]))
        again = httpx.post(f"{on_b}/messages", json={"content": "go on"}, timeout=10)
    finally:
        a.stop()
        b.stop()
    post.join()

    print(f"follower ended {noticed_after:.2f} s after the kill; Stop took {stop_took:.3f} s")
    # Three missed beats of 0.5 s, plus the follower's one-second wait for events, plus slack.
    assert noticed_after < 4.5
    name, data = events[-1][1], events[-1][2]
    assert name == "done" and data["status"] == "interrupted"
    assert data["assistant_message_id"] == post.events[0][2]["assistant_message_id"]
    assert [seq for seq, _, _ in events] == list(range(2, 2 + len(events))), "the ending event follows the last"
    assert stop.status_code == 204 and stop_took < 1.0
    assert [c["streaming"] for c in listed] == [False]
    assert conv["streaming"] is False and conv["turn"] is None
    assert conv["messages"][-1]["status"] == "interrupted"
    assert text_of(events).startswith(conv["messages"][-1]["content"]), "the reply stored is its last checkpoint"
    assert parse_sse(again.text)[-1][0] == "done"
