"""One contract for every store implementation: what routes and turns may rely on, whichever runs.

Each test runs on the file store and on the Redis store (a real redis-server with AOF on).
"""

from __future__ import annotations

import asyncio

import pytest

from chatserver.conversations.document import SCHEMA_VERSION, new_id, now_iso
from chatserver.store.files import FileStore, LockLost, NotFound, TurnBusy
from chatserver.store.redis import RedisStore
from redis_support import unique_prefix


@pytest.fixture(params=["files", "redis"])
async def store(request, tmp_path):
    if request.param == "files":
        files = FileStore(tmp_path / "data")
        yield files
        await files.flush()
    else:
        server = request.getfixturevalue("redis_server")
        redis = RedisStore(server.url, prefix=unique_prefix())
        yield redis
        await redis.close()


async def reopened(store):
    """A second instance on the same data, as another process (or a restart) would see it."""
    if isinstance(store, FileStore):
        await store.flush()
        return FileStore(store.root)
    return RedisStore(store.url, prefix=store.prefix)


def conversation(**fields) -> dict:
    created = now_iso()
    return {"id": new_id(), "title": "New conversation", "model": "m-1", "created_at": created,
            "updated_at": created, "settings": {"temperature": 0.5}, **fields}


def message(text: str, role: str = "user") -> dict:
    return {"id": new_id(), "role": role, "content": text, "created_at": now_iso()}


def append(msg: dict):
    return lambda conv: conv["messages"].append(msg)


async def test_create_get_update_delete(store):
    mine = store.for_owner("alice")
    conv = await mine.create(conversation(title="Plans"))
    assert conv["owner"] == "alice" and conv["messages"] == [] and conv["schema_version"] == SCHEMA_VERSION
    first, second = message("안녕하세요"), message("hello", "assistant")
    await mine.update(conv["id"], append(first))
    updated = await mine.update(conv["id"], append(second))
    assert [m["content"] for m in updated["messages"]] == ["안녕하세요", "hello"]

    other = (await reopened(store)).for_owner("alice")
    again = await other.get(conv["id"])
    assert again["messages"] == [first, second] and again["title"] == "Plans"
    assert again["settings"] == {"temperature": 0.5} and again["updated_at"] >= conv["created_at"]
    assert set(again) == set(updated)

    await mine.delete(conv["id"])
    with pytest.raises(NotFound):
        await mine.get(conv["id"])
    with pytest.raises(NotFound):
        await other.get(conv["id"])
    assert await mine.list() == []


async def test_a_change_that_fails_stores_nothing(store):
    mine = store.for_owner("alice")
    conv = await mine.create(conversation())
    await mine.update(conv["id"], append(message("kept")))

    def half_then_fail(c: dict) -> None:
        c["messages"].append(message("half"))
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError):
        await mine.update(conv["id"], half_then_fail)
    assert [m["content"] for m in (await mine.get(conv["id"]))["messages"]] == ["kept"]
    fresh = (await reopened(store)).for_owner("alice")
    assert [m["content"] for m in (await fresh.get(conv["id"]))["messages"]] == ["kept"]


async def test_concurrent_updates_all_land_in_the_order_made(store):
    mine = store.for_owner("alice")
    conv = await mine.create(conversation())
    await asyncio.gather(*(mine.update(conv["id"], append(message(f"m{i}"))) for i in range(40)))
    expected = [f"m{i}" for i in range(40)]
    assert [m["content"] for m in (await mine.get(conv["id"]))["messages"]] == expected
    fresh = (await reopened(store)).for_owner("alice")
    assert [m["content"] for m in (await fresh.get(conv["id"]))["messages"]] == expected


async def test_another_owners_id_is_not_found_everywhere(store):
    alice, bob = store.for_owner("alice"), store.for_owner("bob")
    conv = await alice.create(conversation(title="Alice's"))
    await alice.update(conv["id"], append(message("private")))
    with pytest.raises(NotFound):
        await bob.get(conv["id"])
    with pytest.raises(NotFound):
        await bob.update(conv["id"], lambda c: c.update(title="Bob's"))
    with pytest.raises(NotFound):
        await bob.update_soon(conv["id"], lambda c: c.update(title="Bob's"))
    with pytest.raises(NotFound):
        await bob.delete(conv["id"])
    with pytest.raises(NotFound):
        await bob.lock_turn(conv["id"])
    lock = await alice.lock_turn(conv["id"])
    with pytest.raises(NotFound):  # a running turn of Alice's is not even "busy" to Bob
        await bob.turn_locked(conv["id"])
    await alice.unlock_turn(lock)
    assert await bob.list() == []
    for unknown in (new_id(), "../../etc/passwd", "short"):
        with pytest.raises(NotFound):
            await alice.get(unknown)
    fresh = (await reopened(store)).for_owner("alice")
    kept = await fresh.get(conv["id"])
    assert kept["title"] == "Alice's" and [m["content"] for m in kept["messages"]] == ["private"]
    assert not await alice.turn_locked(conv["id"])


async def test_another_owners_lookups_never_disturb_the_owners_reads(store):
    alice, bob = store.for_owner("alice"), store.for_owner("bob")
    conv = await alice.create(conversation(title="Alice's"))
    await alice.get(conv["id"])

    async def bob_tries() -> None:
        with pytest.raises(NotFound):
            await bob.get(conv["id"])

    # Interleaved, as a request of Bob's lands while one of Alice's waits for the store's answer.
    reads = await asyncio.gather(*(call for _ in range(30) for call in (alice.get(conv["id"]), bob_tries())))
    assert [r["title"] for r in reads if r is not None] == ["Alice's"] * 30


async def test_list_is_the_owners_own_with_update_times(store):
    alice, bob = store.for_owner("alice"), store.for_owner("bob")
    a1 = await alice.create(conversation(title="a1"))
    a2 = await alice.create(conversation(title="a2"))
    b1 = await bob.create(conversation(title="b1"))
    # Each update lands at a later millisecond, so the update times order them unambiguously.
    for conv_id in (a2["id"], a1["id"]):
        stamp = now_iso()
        while now_iso() == stamp:
            await asyncio.sleep(0.001)
        await alice.update(conv_id, append(message("hi")))
    entries = await alice.list()
    assert {e["id"] for e in entries} == {a1["id"], a2["id"]}
    newest_first = sorted(entries, key=lambda e: e["updated_at"], reverse=True)
    assert [e["title"] for e in newest_first] == ["a1", "a2"]
    assert newest_first[0] == {"id": a1["id"], "title": "a1", "model": "m-1",
                               "updated_at": newest_first[0]["updated_at"], "message_count": 1,
                               "last_message_at": newest_first[0]["last_message_at"],
                               "pinned": False, "archived": False, "project_id": None}
    assert [e["id"] for e in await bob.list()] == [b1["id"]]


async def test_memory_is_per_owner(store):
    alice, bob = store.for_owner("alice"), store.for_owner("bob")
    assert await alice.read_memory() == ""
    await alice.write_memory("좋아하는 색: 파랑\n")
    await bob.write_memory("likes tea")
    fresh = await reopened(store)
    assert await fresh.for_owner("alice").read_memory() == "좋아하는 색: 파랑\n"
    assert await fresh.for_owner("bob").read_memory() == "likes tea"
    assert await fresh.for_owner("carol").read_memory() == ""


async def test_custom_models(store):
    assert await store.read_custom_models() == []
    models = [{"id": "my-model", "tier": "fast", "label": "Mine"}, {"id": "other"}]
    await store.write_custom_models(models)
    assert await (await reopened(store)).read_custom_models() == models


async def test_mcp_servers_added_in_the_page(store):
    assert await store.read_mcp_servers() == []
    servers = [{"name": "search", "url": "http://127.0.0.1:9/mcp", "transport": "http",
                "headers": {"Authorization": "Bearer s3cret"}}]
    await store.write_mcp_servers(servers)
    assert await (await reopened(store)).read_mcp_servers() == servers


async def test_turn_locks(store):
    mine = store.for_owner("alice")
    conv = await mine.create(conversation())
    lock = await mine.lock_turn(conv["id"])
    assert await mine.turn_locked(conv["id"])
    with pytest.raises(TurnBusy):
        await mine.lock_turn(conv["id"])
    await mine.unlock_turn(lock)
    assert not await mine.turn_locked(conv["id"])
    second = await mine.lock_turn(conv["id"])
    await mine.unlock_turn(lock)  # the first claim is stale: releasing it again changes nothing
    assert await mine.turn_locked(conv["id"])
    with pytest.raises(TurnBusy):
        await mine.lock_turn(conv["id"])
    await mine.unlock_turn(second)
    assert not await mine.turn_locked(conv["id"])


async def test_a_write_with_a_stale_lock_is_refused(store):
    mine = store.for_owner("alice")
    conv = await mine.create(conversation())
    old = await mine.lock_turn(conv["id"])
    await mine.update(conv["id"], append(message("from the old turn")), lock=old)
    await mine.unlock_turn(old)
    new = await mine.lock_turn(conv["id"])
    with pytest.raises(LockLost):
        await mine.update(conv["id"], append(message("late")), lock=old)
    with pytest.raises(LockLost):
        await mine.update_soon(conv["id"], append(message("late")), lock=old)
    await mine.update(conv["id"], append(message("from the new turn")), lock=new)
    contents = [m["content"] for m in (await mine.get(conv["id"]))["messages"]]
    assert contents == ["from the old turn", "from the new turn"]
    # A write without a lock (a rename) is not a turn's and goes through meanwhile.
    await mine.update(conv["id"], lambda c: c.update(title="Renamed"))
    assert (await mine.get(conv["id"]))["title"] == "Renamed"


async def test_update_soon_is_visible_at_once(store):
    mine = store.for_owner("alice")
    conv = await mine.create(conversation())
    seen, durable = await mine.update_soon(conv["id"], append(message("now")))
    assert [m["content"] for m in seen["messages"]] == ["now"]
    assert [m["content"] for m in (await mine.get(conv["id"]))["messages"]] == ["now"]
    assert next(e for e in await mine.list() if e["id"] == conv["id"])["message_count"] == 1
    await durable
    fresh = (await reopened(store)).for_owner("alice")
    assert [m["content"] for m in (await fresh.get(conv["id"]))["messages"]] == ["now"]


async def test_rewrites_that_are_not_appends(store):
    """A compression folds messages into the archive and removes them: the stored lists follow."""
    mine = store.for_owner("alice")
    conv = await mine.create(conversation())
    for i in range(6):
        await mine.update(conv["id"], append(message(f"m{i}")))

    def fold(c: dict) -> None:
        c.setdefault("archive", []).extend(c["messages"][:4])
        del c["messages"][:4]
        c["messages"][0]["content"] = "edited in place"
        c["summary"] = "four messages folded"

    await mine.update(conv["id"], fold)
    fresh = await (await reopened(store)).for_owner("alice").get(conv["id"])
    assert [m["content"] for m in fresh["messages"]] == ["edited in place", "m5"]
    assert [m["content"] for m in fresh["archive"]] == ["m0", "m1", "m2", "m3"]
    assert fresh["summary"] == "four messages folded"


async def test_changes_tell_every_write_and_deletion_in_order(store):
    """The feed search follows: subscribed before the writes, it hears each one (from any instance
    on the same data for Redis), checkpoints marked as such, then the deletion."""
    feed = await store.changes()
    mine = store.for_owner("alice")
    conv = await mine.create(conversation())
    streaming = {**message("part", "assistant"), "status": "streaming"}
    await mine.update(conv["id"], append(streaming))
    await mine.delete(conv["id"])
    seen = []
    async with asyncio.timeout(10):
        while not seen or not seen[-1].deleted:
            change = await anext(feed)
            seen.append(change)
    await feed.aclose()
    assert {(c.owner, c.conv_id) for c in seen} == {("alice", conv["id"])}
    assert [c.streaming for c in seen] == [False, True, False]
    assert [c.deleted for c in seen] == [False, False, True]


async def test_presets_are_per_owner_and_changed_in_one_step(store):
    """Each person's presets document; concurrent changes all land (none computed from a stale read)."""
    alice, bob = store.for_owner("alice"), store.for_owner("bob")
    assert await alice.read_presets() is None

    async def add(name: str) -> None:
        await alice.update_presets(lambda raw: b"%s,%s" % (raw or b"", name.encode()))

    await asyncio.gather(*(add(f"p{i}") for i in range(10)))
    stored = (await (await reopened(store)).for_owner("alice").read_presets()).split(b",")
    assert sorted(stored[1:]) == sorted(f"p{i}".encode() for i in range(10))
    assert await bob.read_presets() is None

    with pytest.raises(RuntimeError):
        await alice.update_presets(lambda raw: (_ for _ in ()).throw(RuntimeError("refused")))
    assert (await alice.read_presets()).count(b",") == 10
    await alice.forget_presets()
    assert await alice.read_presets() is None
