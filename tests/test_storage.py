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
from storage import Damaged, NotFound, Store, new_id, valid_id

ROOT = Path(__file__).resolve().parent.parent

WRITER = textwrap.dedent("""
    import asyncio, sys
    sys.path.insert(0, sys.argv[2])
    from storage import Store

    async def main():
        store = Store(sys.argv[1])
        conv_id = sys.argv[3]
        padding = "x" * 20000
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
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(ROOT), conv_id],
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

    assert conv["schema_version"] == 1 and conv["summary"] == "" and conv["totals"]["turns"] == 0
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
