"""What only the Redis store promises: several processes (here: several clients) on one Redis,
appended messages, fenced locks that expire, expiry by inactivity, and Redis going away and back."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import redis as sync_redis

from chatserver.conversations.document import new_id
from chatserver.store.files import LockLost, NotFound, TurnBusy
from chatserver.store.redis import RECHECK, RedisStore, StoreUnavailable
from redis_support import RedisServer, unique_prefix
from test_store_contract import append, conversation, message


async def wait_until(predicate, timeout: float = 10, what: str = "the condition"):
    """Poll an async predicate until it holds, failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        await asyncio.sleep(0.02)


@pytest.fixture
async def two(redis_server):
    """Two stores on one Redis, as two server processes would have."""
    prefix = unique_prefix()
    a = RedisStore(redis_server.url, prefix=prefix, lock_ttl_ms=400)
    b = RedisStore(redis_server.url, prefix=prefix, lock_ttl_ms=400)
    yield a, b
    await a.close()
    await b.close()


def raw(server) -> sync_redis.Redis:
    return sync_redis.Redis.from_url(server.url)


async def test_made_on_one_process_listed_read_and_continued_on_another(two):
    a, b = (s.for_owner("alice") for s in two)
    conv = await a.create(conversation(title="Shared"))
    await a.update(conv["id"], append(message("from A")))
    assert [e["id"] for e in await b.list()] == [conv["id"]]
    await b.update(conv["id"], append(message("from B")))
    # A's cached copy is older than B's write: A's read and A's next write both see B's message.
    assert [m["content"] for m in (await a.get(conv["id"]))["messages"]] == ["from A", "from B"]
    await a.update(conv["id"], append(message("A again")))
    assert [m["content"] for m in (await b.get(conv["id"]))["messages"]] == ["from A", "from B", "A again"]


async def test_concurrent_writers_on_two_processes_lose_nothing(two):
    a, b = (s.for_owner("alice") for s in two)
    conv = await a.create(conversation())
    await asyncio.gather(*(s.update(conv["id"], append(message(f"{name}{i}")))
                           for i in range(20) for name, s in (("a", a), ("b", b))))
    contents = [m["content"] for m in (await b.get(conv["id"]))["messages"]]
    assert sorted(contents) == sorted(f"{n}{i}" for i in range(20) for n in "ab")
    # Each process's own writes keep the order they were made in.
    for name in "ab":
        assert [c for c in contents if c[0] == name] == [f"{name}{i}" for i in range(20)]


async def test_list_is_newest_first(redis_server):
    store = RedisStore(redis_server.url, prefix=unique_prefix())
    mine = store.for_owner("alice")
    ids = [(await mine.create(conversation(title=f"c{i}", updated_at=f"2026-01-0{i + 1}T00:00:00.000Z")))["id"]
           for i in range(3)]
    assert [e["id"] for e in await mine.list()] == ids[::-1]
    await mine.update(ids[0], lambda c: c.update(title="touched"))
    assert [e["title"] for e in await mine.list()] == ["touched", "c2", "c1"]
    await store.close()


async def test_messages_are_appended_not_rewritten(redis_server):
    store = RedisStore(redis_server.url, prefix=unique_prefix())
    mine = store.for_owner("alice")
    conv = await mine.create(conversation())
    for i in range(5):
        await mine.update(conv["id"], append(message(f"m{i}")))
    r = raw(redis_server)
    key = f"{store.conv_key(conv['id'])}:messages"
    r.config_resetstat()
    for i in range(5, 25):
        await mine.update(conv["id"], append(message(f"m{i}")))
    stats = r.info("commandstats")
    # Twenty writes: twenty RPUSHes of one message each, and the list was never deleted.
    assert stats["cmdstat_rpush"]["calls"] == 20
    assert "cmdstat_del" not in stats
    assert r.llen(key) == 25

    # A reply checkpointed in place: only the last item is replaced (LTRIM, then one RPUSH).
    r.config_resetstat()
    await mine.update(conv["id"], lambda c: c["messages"][-1].update(content="m24, longer"))
    stats = r.info("commandstats")
    assert stats["cmdstat_ltrim"]["calls"] == 1 and stats["cmdstat_rpush"]["calls"] == 1
    assert "cmdstat_del" not in stats

    # An earlier message edited: the list is cut there and the rest pushed again, whole and right.
    await mine.update(conv["id"], lambda c: c["messages"][1].update(content="edited"))
    # The oldest message replaced by a new object (the way old messages change): rewritten from it.
    r.config_resetstat()
    await mine.update(conv["id"], lambda c: c["messages"].__setitem__(0, {**c["messages"][0], "content": "new m0"}))
    assert r.info("commandstats")["cmdstat_del"]["calls"] == 1
    fresh = await RedisStore(redis_server.url, prefix=store.prefix).for_owner("alice").get(conv["id"])
    assert [m["content"] for m in fresh["messages"]] == ["new m0", "edited", *[f"m{i}" for i in range(2, 24)],
                                                         "m24, longer"]
    assert r.llen(key) == 25
    r.close()
    await store.close()


async def test_an_old_message_replaced_beyond_the_recheck_window_is_stored(redis_server):
    store = RedisStore(redis_server.url, prefix=unique_prefix())
    mine = store.for_owner("alice")
    conv = await mine.create(conversation())
    count = RECHECK + 100
    await mine.update(conv["id"], lambda c: c["messages"].extend(message(f"m{i}") for i in range(count)))

    def replace_third(c: dict) -> None:
        c["messages"][2] = {**c["messages"][2], "content": "replaced"}

    await mine.update(conv["id"], replace_third)
    fresh = await RedisStore(redis_server.url, prefix=store.prefix).for_owner("alice").get(conv["id"])
    assert [m["content"] for m in fresh["messages"]] == ["m0", "m1", "replaced", *[f"m{i}" for i in range(3, count)]]
    await store.close()


async def test_a_long_conversation_loads_in_one_script_call_and_only_when_changed(redis_server):
    store = RedisStore(redis_server.url, prefix=unique_prefix())
    mine = store.for_owner("alice")
    conv = await mine.create(conversation())
    await mine.update(conv["id"], lambda c: c["messages"].extend(message(f"m{i}") for i in range(3000)))
    r = raw(redis_server)
    r.config_resetstat()
    for _ in range(5):
        assert len((await mine.get(conv["id"]))["messages"]) == 3000
    stats = r.info("commandstats")
    # Unchanged since this process wrote it: the script answers the version, not 3000 messages.
    assert "cmdstat_lrange" not in stats and stats["cmdstat_evalsha"]["calls"] == 5
    other = RedisStore(redis_server.url, prefix=store.prefix).for_owner("alice")
    assert len((await other.get(conv["id"]))["messages"]) == 3000
    assert r.info("commandstats")["cmdstat_lrange"]["calls"] == 2  # messages and archive, once
    r.close()
    await store.close()


async def test_fencing_across_processes(two):
    """A's lock expires while A is paused; B takes the conversation; A's late write is refused."""
    a, b = (s.for_owner("alice") for s in two)
    conv = await a.create(conversation())
    lock_a = await a.lock_turn(conv["id"])
    with pytest.raises(TurnBusy):
        await b.lock_turn(conv["id"])
    await a.update(conv["id"], append(message("A's turn, in time")), lock=lock_a)
    await wait_until(lambda: _not(b.turn_locked(conv["id"])), what="A's unrenewed lock expiring")
    lock_b = await b.lock_turn(conv["id"])
    assert lock_b.fence > lock_a.fence
    assert not await a.renew_turn(lock_a)
    with pytest.raises(LockLost):
        await a.update(conv["id"], append(message("A, too late")), lock=lock_a)
    await b.update(conv["id"], append(message("B's turn")), lock=lock_b)
    await a.unlock_turn(lock_a)  # releasing a lost lock must not release B's
    assert await a.turn_locked(conv["id"])
    contents = [m["content"] for m in (await a.get(conv["id"]))["messages"]]
    assert contents == ["A's turn, in time", "B's turn"]


async def _not(awaitable) -> bool:
    return not await awaitable


async def test_a_renewed_lock_outlives_its_expiry(two):
    a, b = (s.for_owner("alice") for s in two)
    conv = await a.create(conversation())
    lock = await a.lock_turn(conv["id"])
    started = time.monotonic()
    while time.monotonic() - started < 1.2:  # three times the 400 ms expiry
        assert await a.renew_turn(lock)
        with pytest.raises(TurnBusy):
            await b.lock_turn(conv["id"])
        await asyncio.sleep(0.1)  # the renewal period being tested, not a wait for an event
    await a.update(conv["id"], append(message("still mine")), lock=lock)
    await a.unlock_turn(lock)
    assert not await b.turn_locked(conv["id"])
    await b.unlock_turn(await b.lock_turn(conv["id"]))


async def test_conversations_expire_after_inactivity(redis_server):
    store = RedisStore(redis_server.url, prefix=unique_prefix(), ttl_seconds=0.6)
    mine = store.for_owner("alice")
    old = await mine.create(conversation(title="old"))
    await mine.update(old["id"], append(message("bye")))
    kept = await mine.create(conversation(title="kept"))
    r = raw(redis_server)
    assert 0 < r.pttl(store.conv_key(old["id"])) <= 600
    assert 0 < r.pttl(f"{store.conv_key(old['id'])}:messages") <= 600

    async def old_gone() -> bool:
        # Touch `kept` meanwhile: each write pushes its expiry back.
        await mine.update(kept["id"], lambda c: c.update(title="kept"))
        return not r.exists(store.conv_key(old["id"]))

    await wait_until(old_gone, what="the untouched conversation expiring")
    assert r.zcard(store.index_key("alice")) == 2  # the index still names it until a list meets it
    assert [e["title"] for e in await mine.list()] == ["kept"]
    assert r.zcard(store.index_key("alice")) == 1
    assert not r.exists(f"{store.conv_key(old['id'])}:messages")
    with pytest.raises(NotFound):
        await mine.get(old["id"])
    r.close()
    await store.close()


async def test_redis_restart_mid_run(tmp_path):
    """Kill Redis: calls fail fast with StoreUnavailable; start it again: nothing acknowledged is
    lost and the same store instance carries on."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    store = RedisStore(server.url, prefix="p:")
    mine = store.for_owner("alice")
    try:
        conv = await mine.create(conversation())
        for i in range(30):
            await mine.update(conv["id"], append(message(f"m{i}")))
        lock = await mine.lock_turn(conv["id"])
        await mine.write_memory("remember me")

        server.stop(signal.SIGKILL)
        for call in (lambda: mine.get(new_id()), lambda: mine.update(conv["id"], append(message("lost"))),
                     mine.list, lambda: mine.lock_turn(conv["id"]), mine.read_memory):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match=f"Redis at redis://127.0.0.1:{server.port}/0 is unreachable"):
                await call()
            assert time.monotonic() - started < 3

        server.start()
        again = await mine.get(conv["id"])
        assert [m["content"] for m in again["messages"]] == [f"m{i}" for i in range(30)]
        assert await mine.read_memory() == "remember me"
        await mine.update(conv["id"], append(message("after")), lock=lock)  # the turn lock survived too
        await mine.unlock_turn(lock)
        fresh = RedisStore(server.url, prefix="p:")
        assert (await fresh.for_owner("alice").get(conv["id"]))["messages"][-1]["content"] == "after"
        await fresh.close()
    finally:
        await store.close()
        server.stop()


async def test_kv_seam(redis_server):
    store = RedisStore(redis_server.url, prefix=unique_prefix())
    assert await store.get_json("users:alice") is None
    assert await store.set_json("users:alice", {"name": "Alice", "roles": ["admin"]})
    assert not await store.set_json("users:alice", {"name": "Mallory"}, only_if_absent=True)
    await store.set_json("sessions:abc", {"user": "alice"}, ttl_seconds=60)
    assert await store.get_json("users:alice") == {"name": "Alice", "roles": ["admin"]}
    assert await store.json_keys("users:") == ["users:alice"]
    assert await store.delete_json("sessions:abc") and await store.get_json("sessions:abc") is None
    with pytest.raises(ValueError):
        await store.get_json("../*")
    await store.close()


async def test_stop_published_on_one_process_reaches_the_turn_on_another(two):
    a, b = two
    mine = a.for_owner("alice")
    conv = await mine.create(conversation())
    other = await mine.create(conversation())
    async with a.subscribe_stop(conv["id"]) as stopped, a.subscribe_stop(other["id"]) as other_stopped:
        assert not stopped.is_set()
        assert await b.publish_stop(conv["id"]) >= 1
        await asyncio.wait_for(stopped.wait(), 5)
        assert not other_stopped.is_set()  # only the named conversation's turn is stopped
    # Outside the block nothing waits for it any more.
    assert a._stops.waiting == {}


async def test_a_reply_stop_reaches_only_that_reply_and_a_whole_stop_no_reply(two):
    a, b = two
    conv = await a.for_owner("alice").create(conversation())
    async with a.subscribe_stop(conv["id"]) as whole, a.subscribe_stop(conv["id"], "reply-one") as one, \
            a.subscribe_stop(conv["id"], "reply-two") as two_:
        assert await b.publish_stop(conv["id"], "reply-one") >= 1
        await asyncio.wait_for(one.wait(), 5)
        assert await b.publish_stop(conv["id"]) >= 1
        await asyncio.wait_for(whole.wait(), 5)
        # Each listener's messages arrive in order: by now a stray set of reply-two would have shown.
        assert not two_.is_set()
    assert a._stops.waiting == {}


async def test_stop_subscription_comes_back_after_a_redis_restart(tmp_path):
    server = RedisServer(tmp_path / "redis")
    server.start()
    a, b = RedisStore(server.url, prefix="p:"), RedisStore(server.url, prefix="p:")
    try:
        async with a.subscribe_stop("conversation-1") as stopped:
            server.stop(signal.SIGKILL)
            with pytest.raises(StoreUnavailable):
                await b.publish_stop("conversation-1")
            server.start()
            # The listener subscribes again by itself; until it has, nobody hears the stop.
            deadline = time.monotonic() + 10
            while await b.publish_stop("conversation-1") == 0:
                assert time.monotonic() < deadline, "the stop subscription did not come back"
                await asyncio.sleep(0.02)
            await asyncio.wait_for(stopped.wait(), 5)
    finally:
        await a.close()
        await b.close()
        server.stop()


async def test_turn_events_replay_and_follow_exactly_once(two):
    a, b = two
    conv_id = new_id()
    for seq in range(1, 4):
        await a.append_turn_event(conv_id, "turn-1", seq, f"event {seq}".encode())
    await a.append_turn_event(conv_id, "turn-1", 3, b"event 3 again")  # a retried append changes nothing

    async def writer():
        for seq in range(4, 8):
            await asyncio.sleep(0.01)  # the turn producing events while the reader follows
            await a.append_turn_event(conv_id, "turn-1", seq, f"event {seq}".encode(), last=seq == 7,
                                      keep_seconds=30)

    task = asyncio.create_task(writer())
    seen = [(seq, frame) async for seq, frame in b.read_turn_events(conv_id, after=1)]
    await task
    assert seen == [(seq, f"event {seq}".encode()) for seq in range(2, 8)]
    # A re-attach after the end still replays, until the kept events expire.
    assert [seq async for seq, _ in b.read_turn_events(conv_id, after=5)] == [6, 7]
    r = raw_url(b.url)
    assert 0 < r.pttl(b.events_key(conv_id)) <= 30_000
    # The next turn starts a fresh stream; a reader of the old turn stops where it ends.
    await a.append_turn_event(conv_id, "turn-2", 1, b"new turn")
    following = b.read_turn_events(conv_id)
    assert await asyncio.wait_for(anext(following), 5) == (1, b"new turn")
    await following.aclose()
    assert [f async for _, f in b.read_turn_events(conv_id, turn_id="turn-1")] == []
    r.delete(b.events_key(conv_id))
    # No turn's events kept: the read ends at once instead of waiting forever.
    assert [e async for e in b.read_turn_events(conv_id, block_ms=50)] == []
    r.close()


def raw_url(url: str) -> sync_redis.Redis:
    return sync_redis.Redis.from_url(url)


async def test_the_cache_is_bounded_and_reads_stay_right(redis_server, monkeypatch):
    monkeypatch.setattr("chatserver.store.redis.CACHED_CONVERSATIONS", 2)
    store = RedisStore(redis_server.url, prefix=unique_prefix())
    mine = store.for_owner("alice")
    convs = [await mine.create(conversation(title=f"c{i}")) for i in range(4)]
    for conv in convs:
        await mine.update(conv["id"], append(message(conv["title"])))
    assert len(store._cache) == 2
    for conv in convs:
        assert [m["content"] for m in (await mine.get(conv["id"]))["messages"]] == [conv["title"]]
    assert list(store._cache) == [convs[2]["id"], convs[3]["id"]]
    await store.close()


async def test_a_checkpoint_left_by_a_dead_turn_reads_interrupted_once_its_lock_expired(two):
    a, b = (s.for_owner("alice") for s in two)
    conv = await a.create(conversation())
    usage = {"input_tokens": 12, "output_tokens": 3, "cached_tokens": 0, "cache_write_tokens": 0,
             "cost": None, "searches": 0, "fetches": 0, "estimated": True}
    checkpoint = {**message("Half a", role="assistant"), "status": "streaming", "usage": usage, "model": "m"}
    lock = await a.lock_turn(conv["id"])
    await a.update(conv["id"], lambda c: c["messages"].extend([message("hi"), checkpoint]), lock=lock)

    # The turn holds its lock (on "A"): "B" shows the reply streaming, as it is.
    live = await b.get(conv["id"])
    assert live["messages"][-1]["status"] == "streaming" and live["totals"]["turns"] == 0
    # "A" dies: nobody renews the lock, and once it expired the checkpoint is all that is left.
    await wait_until(lambda: _not(b.turn_locked(conv["id"])), what="the lock expiring")
    recovered = await b.get(conv["id"])
    reply = recovered["messages"][-1]
    assert (reply["content"], reply["status"], reply["usage"]["estimated"]) == ("Half a", "interrupted", True)
    assert recovered["totals"]["turns"] == 1 and recovered["totals"]["input_tokens"] == 12
    # Answered from a copy: what Redis holds changes only with the next turn's write, once.
    assert (await two[1].load(conv["id"]))["messages"][-1]["status"] == "streaming"
    assert (await b.get(conv["id"]))["totals"]["turns"] == 1
    # The conversation takes a new turn, whose fence refuses any late write of the dead one.
    await b.unlock_turn(await b.lock_turn(conv["id"]))
    with pytest.raises(LockLost):
        await a.update(conv["id"], append(message("late")), lock=lock)


async def _not(awaitable) -> bool:
    return not await awaitable
