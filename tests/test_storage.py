"""The store: atomic writes that survive a killed process, damaged files left alone, safe ids."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import storage
from storage import SCHEMA_VERSION, Damaged, NotFound, Store, new_id, valid_id

ROOT = Path(__file__).resolve().parent.parent

WRITER = textwrap.dedent("""
    import asyncio, sys
    sys.path.insert(0, sys.argv[2])
    import storage
    from storage import Store

    async def main():
        store = Store(sys.argv[1])
        conv_id = sys.argv[3]
        padding = "x" * int(sys.argv[4])
        if len(sys.argv) > 5:  # seal every few messages, so kills land mid-seal too
            storage.SEGMENT_MESSAGES = int(sys.argv[5])
            storage.SEAL_AFTER = 2 * storage.SEGMENT_MESSAGES
        while True:
            await store.update(conv_id, lambda c: c["messages"].append(
                {"id": str(len(c["messages"])), "role": "user", "content": padding}))
            print(len(store.get(conv_id)["messages"]), flush=True)

    asyncio.run(main())
""")


async def test_a_process_killed_mid_write_never_leaves_torn_json(tmp_path):
    store = Store(tmp_path)
    conv_id = new_id()
    await store.create({"id": conv_id, "model": "m", "settings": {}})
    path = store.conversations_dir / f"{conv_id}.json"
    committed = 0
    for round_ in range(8):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(ROOT), conv_id, "20000"],
                                  stdout=subprocess.PIPE, text=True)
        # Read a few acknowledged writes, then kill at an arbitrary point of the next one.
        for _ in range(3 + round_):
            committed = max(committed, int(writer.stdout.readline()))
        time.sleep(0.001 * round_)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
        data = json.loads(path.read_text())  # must parse: old or new version, never a mix
        assert len(data["messages"]) >= committed
    assert not [p for p in store.conversations_dir.iterdir() if p.suffix == ".json" and p != path]


async def test_a_process_killed_while_sealing_never_loses_or_shortens_a_conversation(tmp_path):
    store = Store(tmp_path)
    conv_id = new_id()
    await store.create({"id": conv_id, "model": "m", "settings": {}})
    committed = 0
    for round_ in range(8):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(ROOT), conv_id, "2000", "3"],
                                  stdout=subprocess.PIPE, text=True)
        for _ in range(5 + 3 * round_):
            committed = max(committed, int(writer.stdout.readline()))
        time.sleep(0.001 * round_)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
        messages = Store(tmp_path).get(conv_id)["messages"]  # every named segment is there
        assert len(messages) >= committed
        assert [m["id"] for m in messages] == [str(n) for n in range(len(messages))]
    assert on_disk(store, conv_id)["earlier_messages"]


async def test_damaged_file_is_reported_skipped_and_never_overwritten(tmp_path, caplog):
    store = Store(tmp_path)
    good = await store.create({"id": new_id(), "model": "m", "settings": {}})
    bad_id = new_id()
    bad_path = store.conversations_dir / f"{bad_id}.json"
    bad_path.write_text('{"id": "' + bad_id + '", "messages": [')

    assert [c["id"] for c in store.list()] == [good["id"]]
    assert bad_path.name in caplog.text
    with pytest.raises(Damaged):
        store.get(bad_id)
    with pytest.raises(Damaged):
        await store.update(bad_id, lambda c: c.update(title="x"))
    assert bad_path.read_text() == '{"id": "' + bad_id + '", "messages": ['


def test_ids_are_random_and_path_shaped_ids_never_touch_the_disk(tmp_path):
    ids = {new_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(valid_id(i) for i in ids)
    store = Store(tmp_path)
    for hostile in ["../../etc/passwd", "..", "a/b", "x.json", "", "con:1", "\x00abcdefgh"]:
        with pytest.raises(NotFound):
            store.get(hostile)


def test_older_files_are_upgraded_on_read(tmp_path):
    store = Store(tmp_path)
    conv_id = new_id()
    (store.conversations_dir / f"{conv_id}.json").write_text(json.dumps(
        {"id": conv_id, "model": "m", "messages": [{"id": "1", "role": "user", "content": "hi"}]}))

    conv = store.get(conv_id)

    assert conv["schema_version"] == SCHEMA_VERSION and conv["summary"] == "" and conv["totals"]["turns"] == 0
    assert conv["messages"][0]["content"] == "hi"


async def test_writes_queued_from_many_tasks_land_in_the_order_they_were_made(tmp_path):
    store = Store(tmp_path)
    conv = await store.create({"id": new_id(), "model": "m", "settings": {}})

    async def append(n: int) -> None:
        await store.update(conv["id"], lambda c: c["messages"].append({"id": str(n), "role": "user", "content": "x"}))

    await asyncio.gather(*(append(n) for n in range(40)))

    on_disk = json.loads((store.conversations_dir / f"{conv['id']}.json").read_text())
    assert [m["id"] for m in on_disk["messages"]] == [str(n) for n in range(40)]
    assert Store(tmp_path).get(conv["id"])["messages"] == store.get(conv["id"])["messages"]


async def test_a_delete_behind_queued_writes_stays_deleted(tmp_path):
    store = Store(tmp_path)
    conv = await store.create({"id": new_id(), "model": "m", "settings": {}})
    writes = [asyncio.create_task(store.update(conv["id"], lambda c, n=n: c.update(title=str(n)))) for n in range(5)]
    await asyncio.sleep(0)

    await store.delete(conv["id"])
    await asyncio.gather(*writes, return_exceptions=True)

    assert not (store.conversations_dir / f"{conv['id']}.json").exists()
    with pytest.raises(NotFound):
        store.get(conv["id"])
    with pytest.raises(NotFound):
        await store.update(conv["id"], lambda c: c.update(title="again"))


async def test_a_write_left_running_still_lands_before_a_later_one(tmp_path, monkeypatch):
    store = Store(tmp_path)
    conv = await store.create({"id": new_id(), "model": "m", "settings": {}})
    real = storage._write_and_stamp
    slowed = []

    def first_write_slow(path, data):
        if not slowed:
            slowed.append(path)
            time.sleep(0.2)
        return real(path, data)

    monkeypatch.setattr(storage, "_write_and_stamp", first_write_slow)

    _, first = store.update_soon(conv["id"], lambda c: c.update(title="first"))
    assert store.get(conv["id"])["title"] == "first"  # seen at once, before it is on disk
    await store.update(conv["id"], lambda c: c.update(title="second"))

    assert first.done() and slowed
    assert json.loads((store.conversations_dir / f"{conv['id']}.json").read_text())["title"] == "second"


async def test_a_failed_write_is_forgotten_and_the_file_read_again(tmp_path, monkeypatch):
    store = Store(tmp_path)
    conv = await store.create({"id": new_id(), "model": "m", "settings": {}})

    def disk_full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage, "_write_and_stamp", disk_full)
    with pytest.raises(OSError):
        await store.update(conv["id"], lambda c: c.update(title="never stored"))

    assert store.get(conv["id"])["title"] == "New conversation"


def message(n: int) -> dict:
    return {"id": f"m{n}", "role": "user" if n % 2 == 0 else "assistant", "content": f"message number {n}"}


@pytest.fixture
async def long_conversation(tmp_path) -> tuple[Store, str]:
    store = Store(tmp_path)
    conv = await store.create({"id": new_id(), "model": "m", "settings": {}})
    await store.update(conv["id"], lambda c: c["messages"].extend(message(n) for n in range(2500)))
    return store, conv["id"]


def on_disk(store: Store, conv_id: str) -> dict:
    return json.loads((store.conversations_dir / f"{conv_id}.json").read_text())


def earlier_files(store: Store, conv_id: str) -> set[str]:
    return {p.name for p in (store.conversations_dir / f"{conv_id}.earlier").glob("*.json")}


def record_snapshots(monkeypatch) -> list:
    """Every snapshot the store writes from now on, in order."""
    written = []
    real = storage._write_snapshot
    monkeypatch.setattr(storage, "_write_snapshot",
                        lambda path, earlier, snap: written.append(snap) or real(path, earlier, snap))
    return written


async def test_a_long_conversation_rewrites_only_its_recent_messages(long_conversation, monkeypatch):
    store, conv_id = long_conversation
    written = record_snapshots(monkeypatch)

    await store.update(conv_id, lambda c: c["messages"].append(message(2500)))

    (snapshot,) = written
    assert snapshot.segments == []
    file = on_disk(store, conv_id)
    assert len(file["messages"]) < storage.SEAL_AFTER
    assert sum(s["count"] for s in file["earlier_messages"]) + len(file["messages"]) == 2501
    assert {s["file"] for s in file["earlier_messages"]} == earlier_files(store, conv_id)
    whole = len(json.dumps([message(n) for n in range(2501)]))
    assert len(snapshot.data) < whole / 2
    assert Store(store.root).get(conv_id)["messages"] == [message(n) for n in range(2501)]


async def test_a_change_reaching_into_sealed_messages_reseals_and_leaves_no_stale_segment(long_conversation):
    store, conv_id = long_conversation
    before = earlier_files(store, conv_id)

    await store.update(conv_id, lambda c: c.update(messages=c["messages"][1:]))

    assert Store(store.root).get(conv_id)["messages"] == [message(n) for n in range(1, 2500)]
    assert earlier_files(store, conv_id) == {s["file"] for s in on_disk(store, conv_id)["earlier_messages"]}
    assert not before & earlier_files(store, conv_id)


async def test_a_missing_segment_makes_the_conversation_damaged_never_shorter(long_conversation):
    store, conv_id = long_conversation
    lost = sorted(earlier_files(store, conv_id))[0]
    (store.conversations_dir / f"{conv_id}.earlier" / lost).unlink()
    path = store.conversations_dir / f"{conv_id}.json"
    original = path.read_bytes()
    fresh = Store(store.root)

    with pytest.raises(Damaged, match=lost):
        fresh.get(conv_id)
    with pytest.raises(Damaged):
        await fresh.update(conv_id, lambda c: c["messages"].append(message(9999)))
    assert path.read_bytes() == original


async def test_deleting_a_long_conversation_removes_its_segments(long_conversation):
    store, conv_id = long_conversation

    await store.delete(conv_id)

    assert not (store.conversations_dir / f"{conv_id}.earlier").exists()
    assert store.list() == []


async def test_a_long_archive_is_sealed_too(tmp_path, monkeypatch):
    store = Store(tmp_path)
    conv = await store.create({"id": new_id(), "model": "m", "settings": {}})
    await store.update(conv["id"], lambda c: c.update(archive=[message(n) for n in range(2500)]))
    written = record_snapshots(monkeypatch)

    await store.update(conv["id"], lambda c: c["archive"].append(message(2500)))
    await store.update(conv["id"], lambda c: c["messages"].append(message(0)))

    assert [len(s.segments) for s in written] == [0, 0]
    assert len(written[-1].data) < len(json.dumps([message(n) for n in range(2501)])) / 2
    fresh = Store(tmp_path).get(conv["id"])
    assert fresh["archive"] == [message(n) for n in range(2501)] and fresh["messages"] == [message(0)]
    assert "earlier_archive" not in fresh and "earlier_messages" not in fresh


async def test_folding_sealed_messages_into_the_archive_reads_back_whole(long_conversation):
    store, conv_id = long_conversation

    def fold(c: dict) -> None:
        c.setdefault("archive", []).extend(c["messages"][:2000])
        c["messages"] = c["messages"][2000:]

    await store.update(conv_id, fold)

    fresh = Store(store.root).get(conv_id)
    assert fresh["archive"] == [message(n) for n in range(2000)]
    assert fresh["messages"] == [message(n) for n in range(2000, 2500)]
    file = on_disk(store, conv_id)
    referenced = {s["file"] for s in file.get("earlier_archive", []) + file.get("earlier_messages", [])}
    assert referenced == earlier_files(store, conv_id) and file["earlier_archive"]
