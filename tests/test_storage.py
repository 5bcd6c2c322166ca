"""The store: atomic writes that survive a killed process, damaged files left alone, safe ids."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from pathlib import Path

import orjson
import pytest

from chatserver.conversations.document import LOCAL_OWNER, SCHEMA_VERSION, new_id, valid_id
from chatserver.store import files as storage
from chatserver.store.files import Damaged, FileStore, NotFound, checkpoints_beside

ROOT = Path(__file__).resolve().parent.parent

WRITER = textwrap.dedent("""
    import asyncio, itertools, os, sys
    sys.path.insert(0, sys.argv[2])
    from chatserver.store import files as storage
    from chatserver.store.files import FileStore

    async def main():
        store = FileStore(sys.argv[1]).for_owner("local")
        conv_id = sys.argv[3]
        padding = "x" * int(sys.argv[4])
        if len(sys.argv) > 5:  # seal every few messages, so kills land mid-seal too
            storage.SEGMENT_MESSAGES = int(sys.argv[5])
            storage.SEAL_AFTER = 2 * storage.SEGMENT_MESSAGES
        if os.environ.get("CHECKPOINTS") == "1":  # one reply growing, checkpointed again and again
            lock = await store.lock_turn(conv_id)
            for n in itertools.count(1):
                await store.checkpoint(conv_id, {"id": f"reply{os.getpid()}", "role": "assistant",
                                                 "status": "streaming", "content": padding * n}, lock=lock)
                print(n, flush=True)
        while True:
            await store.update(conv_id, lambda c: c["messages"].append(
                {"id": str(len(c["messages"])), "role": "user", "content": padding}))
            print(len((await store.get(conv_id))["messages"]), flush=True)

    asyncio.run(main())
""")


@pytest.mark.parametrize("checkpoints", [False, True], ids=["saves", "checkpoints"])
async def test_a_process_killed_mid_write_never_leaves_torn_json(tmp_path, checkpoints):
    files = FileStore(tmp_path)
    store = files.for_owner(LOCAL_OWNER)
    conv_id = new_id()
    await store.create({"id": conv_id, "model": "m", "settings": {}})
    path = files.conversations_dir / f"{conv_id}.json"
    committed = 0
    for round_ in range(8):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(ROOT), conv_id, "20000"],
                                  stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "CHECKPOINTS": "1" if checkpoints else "0"})
        # Read a few acknowledged writes, then kill at an arbitrary point of the next one.
        acknowledged = [int(writer.stdout.readline()) for _ in range(3 + round_)]
        committed = max(committed, *acknowledged)
        time.sleep(0.001 * round_)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
        data = json.loads(path.read_text())  # must parse: old or new version, never a mix
        if checkpoints:
            # A whole checkpoint is left (a cut one spoils only the slot it was writing), and a fresh
            # process reads the reply up to the last one acknowledged.
            reply = checkpoints_beside(path)[0].message
            assert len(reply["content"]) >= acknowledged[-1] * 20000
            replies = (await FileStore(tmp_path).for_owner(LOCAL_OWNER).get(conv_id))["messages"]
            assert len(replies) == round_ + 1, "an earlier round's reply was lost"
            assert all(m["status"] == "interrupted" for m in replies)
            assert len(replies[-1]["content"]) >= acknowledged[-1] * 20000
        else:
            assert len(data["messages"]) >= committed
    assert not [p for p in files.conversations_dir.iterdir() if p.suffix == ".json" and p != path]
    assert await FileStore(tmp_path).for_owner(LOCAL_OWNER).get(conv_id)


async def test_a_process_killed_while_sealing_never_loses_or_shortens_a_conversation(tmp_path):
    files = FileStore(tmp_path)
    store = files.for_owner(LOCAL_OWNER)
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
        # A fresh read needs every segment the file names to be there.
        messages = (await FileStore(tmp_path).for_owner(LOCAL_OWNER).get(conv_id))["messages"]
        assert len(messages) >= committed
        assert [m["id"] for m in messages] == [str(n) for n in range(len(messages))]
    assert on_disk(files, conv_id)["earlier_messages"]


async def test_damaged_file_is_reported_skipped_and_never_overwritten(tmp_path, caplog):
    files = FileStore(tmp_path)
    store = files.for_owner(LOCAL_OWNER)
    good = await store.create({"id": new_id(), "model": "m", "settings": {}})
    bad_id = new_id()
    bad_path = files.conversations_dir / f"{bad_id}.json"
    bad_path.write_text('{"id": "' + bad_id + '", "messages": [')

    assert [c["id"] for c in await store.list()] == [good["id"]]
    assert bad_path.name in caplog.text
    with pytest.raises(Damaged):
        await store.get(bad_id)
    with pytest.raises(Damaged):
        await store.update(bad_id, lambda c: c.update(title="x"))
    assert bad_path.read_text() == '{"id": "' + bad_id + '", "messages": ['


async def test_ids_are_random_and_path_shaped_ids_never_touch_the_disk(tmp_path):
    ids = {new_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(valid_id(i) for i in ids)
    store = FileStore(tmp_path).for_owner(LOCAL_OWNER)
    for hostile in ["../../etc/passwd", "..", "a/b", "x.json", "", "con:1", "\x00abcdefgh"]:
        with pytest.raises(NotFound):
            await store.get(hostile)


def test_owner_ids_that_could_be_paths_are_refused(tmp_path):
    files = FileStore(tmp_path)
    for hostile in ["../x", "a/b", "", "A" * 65, "UPPER", "\x00"]:
        with pytest.raises(ValueError):
            files.for_owner(hostile)


async def test_older_files_are_upgraded_on_read_and_belong_to_the_local_person(tmp_path):
    files = FileStore(tmp_path)
    conv_id = new_id()
    (files.conversations_dir / f"{conv_id}.json").write_text(json.dumps(
        {"id": conv_id, "model": "m", "messages": [{"id": "1", "role": "user", "content": "hi"}]}))

    conv = await files.for_owner(LOCAL_OWNER).get(conv_id)

    assert conv["schema_version"] == SCHEMA_VERSION and conv["summary"] == "" and conv["totals"]["turns"] == 0
    assert conv["messages"][0]["content"] == "hi" and conv["owner"] == LOCAL_OWNER
    with pytest.raises(NotFound):
        await files.for_owner("someone").get(conv_id)


async def test_writes_queued_from_many_tasks_land_in_the_order_they_were_made(tmp_path):
    files = FileStore(tmp_path)
    store = files.for_owner(LOCAL_OWNER)
    conv = await store.create({"id": new_id(), "model": "m", "settings": {}})

    async def append(n: int) -> None:
        await store.update(conv["id"], lambda c: c["messages"].append({"id": str(n), "role": "user", "content": "x"}))

    await asyncio.gather(*(append(n) for n in range(40)))

    on_disk = json.loads((files.conversations_dir / f"{conv['id']}.json").read_text())
    assert [m["id"] for m in on_disk["messages"]] == [str(n) for n in range(40)]
    fresh = await FileStore(tmp_path).for_owner(LOCAL_OWNER).get(conv["id"])
    assert fresh["messages"] == (await store.get(conv["id"]))["messages"]


async def test_a_delete_behind_queued_writes_stays_deleted(tmp_path):
    files = FileStore(tmp_path)
    store = files.for_owner(LOCAL_OWNER)
    conv = await store.create({"id": new_id(), "model": "m", "settings": {}})
    writes = [asyncio.create_task(store.update(conv["id"], lambda c, n=n: c.update(title=str(n)))) for n in range(5)]
    await asyncio.sleep(0)

    await store.delete(conv["id"])
    await asyncio.gather(*writes, return_exceptions=True)

    assert not (files.conversations_dir / f"{conv['id']}.json").exists()
    with pytest.raises(NotFound):
        await store.get(conv["id"])
    with pytest.raises(NotFound):
        await store.update(conv["id"], lambda c: c.update(title="again"))


async def test_a_write_left_running_still_lands_before_a_later_one(tmp_path):
    files = FileStore(tmp_path)
    store = files.for_owner(LOCAL_OWNER)
    conv = await store.create({"id": new_id(), "model": "m", "settings": {}})
    slowed = []

    def first_write_slow(path, data):
        if not slowed:
            slowed.append(path)
            time.sleep(0.2)

    files.before_write = first_write_slow

    _, first = await store.update_soon(conv["id"], lambda c: c.update(title="first"))
    assert (await store.get(conv["id"]))["title"] == "first"  # seen at once, before it is on disk
    await store.update(conv["id"], lambda c: c.update(title="second"))

    assert first.done() and slowed
    assert json.loads((files.conversations_dir / f"{conv['id']}.json").read_text())["title"] == "second"


async def test_a_failed_write_is_forgotten_and_the_file_read_again(tmp_path):
    files = FileStore(tmp_path)
    store = files.for_owner(LOCAL_OWNER)
    conv = await store.create({"id": new_id(), "model": "m", "settings": {}})

    def disk_full(path, data):
        raise OSError(28, "No space left on device")

    files.before_write = disk_full
    with pytest.raises(OSError):
        await store.update(conv["id"], lambda c: c.update(title="never stored"))
    assert (await store.get(conv["id"]))["title"] == "New conversation"

    lock = await store.lock_turn(conv["id"])
    with pytest.raises(OSError):
        await store.checkpoint(conv["id"], streaming("never stored either"), lock=lock)
    assert (await store.get(conv["id"]))["messages"] == []

    files.before_write = None
    await store.checkpoint(conv["id"], streaming("stored"), lock=lock)
    assert (await reread(tmp_path, conv["id"]))["messages"][-1]["content"] == "stored"


def streaming(text: str) -> dict:
    """A reply still being written, as a checkpoint stores it."""
    return {"id": "reply", "role": "assistant", "status": "streaming", "content": text}


def message(n: int) -> dict:
    return {"id": f"m{n}", "role": "user" if n % 2 == 0 else "assistant", "content": f"message number {n}"}


@pytest.fixture
async def long_conversation(tmp_path) -> tuple[FileStore, str]:
    files = FileStore(tmp_path)
    conv = await files.for_owner(LOCAL_OWNER).create({"id": new_id(), "model": "m", "settings": {}})
    await files.for_owner(LOCAL_OWNER).update(conv["id"], lambda c: c["messages"].extend(message(n) for n in range(2500)))
    return files, conv["id"]


def on_disk(files: FileStore, conv_id: str) -> dict:
    return json.loads((files.conversations_dir / f"{conv_id}.json").read_text())


def earlier_files(files: FileStore, conv_id: str) -> set[str]:
    return {p.name for p in (files.conversations_dir / f"{conv_id}.earlier").glob("*.json")}


async def reread(root: Path, conv_id: str) -> dict:
    """The conversation as a fresh process would read it."""
    return await FileStore(root).for_owner(LOCAL_OWNER).get(conv_id)


def record_writes(files: FileStore) -> list[tuple[Path, bytes]]:
    """Every file the store writes from now on, in order."""
    written: list[tuple[Path, bytes]] = []
    files.before_write = lambda path, data: written.append((path, data))
    return written


async def test_a_long_conversation_rewrites_only_its_recent_messages(long_conversation):
    files, conv_id = long_conversation
    written = record_writes(files)

    await files.for_owner(LOCAL_OWNER).update(conv_id, lambda c: c["messages"].append(message(2500)))

    ((path, data),) = written  # the conversation file alone: no segment written again
    assert path.name == f"{conv_id}.json"
    file = on_disk(files, conv_id)
    assert len(file["messages"]) < storage.SEAL_AFTER
    assert sum(s["count"] for s in file["earlier_messages"]) + len(file["messages"]) == 2501
    assert {s["file"] for s in file["earlier_messages"]} == earlier_files(files, conv_id)
    whole = len(json.dumps([message(n) for n in range(2501)]))
    assert len(data) < whole / 2
    assert (await reread(files.root, conv_id))["messages"] == [message(n) for n in range(2501)]


async def test_a_change_reaching_into_sealed_messages_reseals_and_leaves_no_stale_segment(long_conversation):
    files, conv_id = long_conversation
    before = earlier_files(files, conv_id)

    await files.for_owner(LOCAL_OWNER).update(conv_id, lambda c: c.update(messages=c["messages"][1:]))

    assert (await reread(files.root, conv_id))["messages"] == [message(n) for n in range(1, 2500)]
    assert earlier_files(files, conv_id) == {s["file"] for s in on_disk(files, conv_id)["earlier_messages"]}
    assert not before & earlier_files(files, conv_id)


async def test_a_missing_segment_makes_the_conversation_damaged_never_shorter(long_conversation):
    files, conv_id = long_conversation
    lost = sorted(earlier_files(files, conv_id))[0]
    (files.conversations_dir / f"{conv_id}.earlier" / lost).unlink()
    path = files.conversations_dir / f"{conv_id}.json"
    original = path.read_bytes()
    fresh = FileStore(files.root).for_owner(LOCAL_OWNER)

    with pytest.raises(Damaged, match=lost):
        await fresh.get(conv_id)
    with pytest.raises(Damaged):
        await fresh.update(conv_id, lambda c: c["messages"].append(message(9999)))
    assert path.read_bytes() == original


async def test_deleting_a_long_conversation_removes_its_segments(long_conversation):
    files, conv_id = long_conversation

    await files.for_owner(LOCAL_OWNER).delete(conv_id)

    assert not (files.conversations_dir / f"{conv_id}.earlier").exists()
    assert await files.for_owner(LOCAL_OWNER).list() == []


async def test_a_long_archive_is_sealed_too(tmp_path):
    files = FileStore(tmp_path)
    store = files.for_owner(LOCAL_OWNER)
    conv = await store.create({"id": new_id(), "model": "m", "settings": {}})
    await store.update(conv["id"], lambda c: c.update(archive=[message(n) for n in range(2500)]))
    written = record_writes(files)

    await store.update(conv["id"], lambda c: c["archive"].append(message(2500)))
    await store.update(conv["id"], lambda c: c["messages"].append(message(0)))

    assert [path.name for path, _ in written] == [f"{conv['id']}.json"] * 2
    assert len(written[-1][1]) < len(json.dumps([message(n) for n in range(2501)])) / 2
    fresh = await reread(tmp_path, conv["id"])
    assert fresh["archive"] == [message(n) for n in range(2501)] and fresh["messages"] == [message(0)]
    assert "earlier_archive" not in fresh and "earlier_messages" not in fresh


async def test_folding_sealed_messages_into_the_archive_reads_back_whole(long_conversation):
    files, conv_id = long_conversation

    def fold(c: dict) -> None:
        c.setdefault("archive", []).extend(c["messages"][:2000])
        c["messages"] = c["messages"][2000:]

    await files.for_owner(LOCAL_OWNER).update(conv_id, fold)

    fresh = await reread(files.root, conv_id)
    assert fresh["archive"] == [message(n) for n in range(2000)]
    assert fresh["messages"] == [message(n) for n in range(2000, 2500)]
    file = on_disk(files, conv_id)
    referenced = {s["file"] for s in file.get("earlier_archive", []) + file.get("earlier_messages", [])}
    assert referenced == earlier_files(files, conv_id) and file["earlier_archive"]


async def test_conversations_untouched_for_the_ttl_are_deleted_by_the_running_server(tmp_path, sim):
    """CONVERSATION_TTL_DAYS: the server deletes what nobody touched that long, at start and then hourly."""
    from chatserver.config import Settings
    from support import serve

    files = FileStore(tmp_path / "data")
    mine = files.for_owner(LOCAL_OWNER)
    old = await mine.create({"id": new_id(), "model": "m", "settings": {}, "updated_at": "2020-01-01T00:00:00.000Z"})
    recent = await mine.create({"id": new_id(), "model": "m", "settings": {}})
    await files.flush()
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        conversation_ttl_days=30)

    async with serve(settings) as (app, client):
        await asyncio.wait_for(app.state.expiry_pass, 10)
        listing = (await client.get("/api/conversations")).json()
        gone = await client.get(f"/api/conversations/{old['id']}")

    assert [c["id"] for c in listing] == [recent["id"]] and gone.status_code == 404
    assert not (files.conversations_dir / f"{old['id']}.json").exists()


async def test_a_checkpoint_write_skips_fsync_and_every_other_write_keeps_it(tmp_path, monkeypatch):
    """Checkpoints are advisory (a power cut may lose one, never the conversation): no fsync for them."""
    files = FileStore(tmp_path)
    store = files.for_owner(LOCAL_OWNER)
    conv = await store.create({"id": new_id(), "model": "m", "settings": {}})
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))

    lock = await store.lock_turn(conv["id"])
    await store.checkpoint(conv["id"], streaming("so far"), lock=lock)
    assert synced == []
    await store.update(conv["id"], lambda c: c.update(title="saved"))
    assert len(synced) == 2  # the file and its directory
    assert (await FileStore(tmp_path).for_owner(LOCAL_OWNER).get(conv["id"]))["title"] == "saved"


async def test_a_checkpoint_slot_holds_every_compared_reply_and_one_written_before_comparisons_still_reads(tmp_path):
    files = FileStore(tmp_path)
    store = files.for_owner(LOCAL_OWNER)
    conv = await store.create({"id": new_id(), "model": "m", "settings": {}, "messages": [message(0)]})
    path = files.conversations_dir / f"{conv['id']}.json"
    lock = await store.lock_turn(conv["id"])
    sibling = {**streaming("the other so far"), "id": "other"}
    await store.checkpoint(conv["id"], None, off_path=[sibling], lock=lock)  # the first has no output yet
    await store.checkpoint(conv["id"], streaming("first so far"), off_path=[sibling], lock=lock)

    [newest, older] = checkpoints_beside(path)
    assert (newest.message, newest.off_path) == (streaming("first so far"), [sibling])
    assert (older.message, older.off_path) == (None, [sibling])
    read = await FileStore(tmp_path).for_owner(LOCAL_OWNER).get(conv["id"])  # a fresh process, after a crash
    assert [(m["id"], m["status"], m["content"]) for m in read["messages"][1:] + read["off_path"]] == [
        ("reply", "interrupted", "first so far"), ("other", "interrupted", "the other so far")]

    # A slot written by the version before (one reply, alone) is still taken in after an upgrade.
    await store.unlock_turn(lock)
    await store.update(conv["id"], lambda c: c.update(messages=[message(0)], off_path=[]))
    old = orjson.dumps(streaming("before the upgrade"))
    (files.conversations_dir / f"{conv['id']}.checkpoint-b").write_bytes(
        b"checkpoint 7 %d %08x\n" % (len(old), zlib.crc32(old)) + old)
    read = await FileStore(tmp_path).for_owner(LOCAL_OWNER).get(conv["id"])
    assert [(m["status"], m["content"]) for m in read["messages"][1:]] == [("interrupted", "before the upgrade")]


async def test_checkpoints_of_many_conversations_are_written_by_one_thread_and_land_whole(tmp_path):
    files = FileStore(tmp_path)
    store = files.for_owner(LOCAL_OWNER)
    convs = [await store.create({"id": new_id(), "model": "m", "settings": {}}) for _ in range(30)]
    writers = set()
    files.before_write = lambda path, data: writers.add(threading.current_thread().name)

    locks = [await store.lock_turn(c["id"]) for c in convs]
    await asyncio.gather(*(store.checkpoint(c["id"], streaming(f"checkpoint {n}"), lock=lock)
                           for n, (c, lock) in enumerate(zip(convs, locks))))

    assert writers == {"checkpoint-writer"}
    fresh = FileStore(tmp_path).for_owner(LOCAL_OWNER)
    assert [(await fresh.get(c["id"]))["messages"][-1]["content"] for c in convs] == [
        f"checkpoint {n}" for n in range(30)]
    assert not [p for p in files.conversations_dir.iterdir() if p.name.endswith(".tmp")]


async def test_a_save_right_behind_a_slow_checkpoint_lands_after_it(tmp_path):
    files = FileStore(tmp_path)
    store = files.for_owner(LOCAL_OWNER)
    conv = await store.create({"id": new_id(), "model": "m", "settings": {}})
    started = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_checkpoint(path, data):
        if b"checkpoint" in data:
            loop.call_soon_threadsafe(started.set)
            time.sleep(0.2)

    files.before_write = slow_checkpoint
    lock = await store.lock_turn(conv["id"])
    checkpoint = asyncio.create_task(store.checkpoint(conv["id"], streaming("checkpoint"), lock=lock))
    await asyncio.wait_for(started.wait(), 10)
    await store.update(conv["id"], lambda c: c["messages"][-1].update(status="complete", content="whole"),
                       lock=lock)

    assert checkpoint.done()
    assert on_disk(files, conv["id"])["messages"][-1]["content"] == "whole"
    assert not checkpoints_beside(files.conversations_dir / f"{conv['id']}.json")
    assert (await reread(tmp_path, conv["id"]))["messages"][-1]["status"] == "complete"



async def test_a_torn_checkpoint_leaves_the_one_before_it(tmp_path):
    """Slots are written in place, by turns: a write cut short spoils its own slot, not the other."""
    files, store, conv, lock = await conversation_with_a_turn(tmp_path)
    await store.checkpoint(conv["id"], streaming("first part"), lock=lock)
    await store.checkpoint(conv["id"], streaming("first part, second part " + "x" * 5000), lock=lock)
    path = files.conversations_dir / f"{conv['id']}.json"
    newest = next(slot for slot in (path.with_suffix(".checkpoint"), path.with_suffix(".checkpoint-b"))
                  if b"second part" in slot.read_bytes())
    whole = newest.read_bytes()
    newest.write_bytes(whole[:4096])  # a crash cut the write after its first page

    assert (await reread(tmp_path, conv["id"]))["messages"][-1]["content"] == "first part"
    newest.write_bytes(whole.replace(b"second", b"sec0nd"))  # same length, wrong CRC
    assert (await reread(tmp_path, conv["id"]))["messages"][-1]["content"] == "first part"


async def test_a_shorter_checkpoint_over_a_longer_one_reads_as_itself(tmp_path):
    """A slot is not truncated: the frame's length, not the file's, tells where the checkpoint ends."""
    files, store, conv, lock = await conversation_with_a_turn(tmp_path)
    for text in ("a long first draft " * 200, "a long first draft", "short"):
        await store.checkpoint(conv["id"], streaming(text), lock=lock)

    assert (await reread(tmp_path, conv["id"]))["messages"][-1]["content"] == "short"
    path = files.conversations_dir / f"{conv['id']}.json"
    assert path.with_suffix(".checkpoint-b").stat().st_size > 2000  # the leftovers are still there


async def conversation_with_a_turn(root: Path):
    """A file store, its local view, a new conversation and the lock of a turn running on it."""
    files = FileStore(root)
    store = files.for_owner(LOCAL_OWNER)
    conv = await store.create({"id": new_id(), "model": "m", "settings": {}})
    return files, store, conv, await store.lock_turn(conv["id"])


async def wait_until(predicate, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_whole_writes_that_gather_share_one_directory_fsync_and_each_file_keeps_its_own(tmp_path, monkeypatch):
    """Group commit: the writes queued while the writer is busy land as one batch, their directory fsynced once."""
    files = FileStore(tmp_path)
    # One thread taking any number at a time, so that what gathers behind the held write is one batch.
    files._whole_writes.threads, files._whole_writes.batch = 1, 100
    store = files.for_owner(LOCAL_OWNER)
    convs = [await store.create({"id": new_id(), "model": "m", "settings": {}}) for _ in range(20)]
    loop = asyncio.get_running_loop()
    held, release, writers = asyncio.Event(), threading.Event(), set()

    def hold_the_first(path, data):
        writers.add(threading.current_thread().name)
        if not held.is_set():
            loop.call_soon_threadsafe(held.set)
            release.wait(10)

    files.before_write = hold_the_first
    directories, plain = [], []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (directories if os.path.isdir(f"/proc/self/fd/{fd}") else plain)
                        .append(fd) or real(fd))

    first = asyncio.create_task(store.update(convs[0]["id"], lambda c: c.update(title="first")))
    await asyncio.wait_for(held.wait(), 10)
    rest = [asyncio.create_task(store.update(c["id"], lambda c: c.update(title="rest"))) for c in convs[1:]]
    await wait_until(lambda: len(files._whole_writes._jobs) == len(rest))
    release.set()
    await asyncio.gather(first, *rest)

    assert writers == {"conversation-writer"}
    assert len(plain) == 20, "each conversation file is fsynced"
    assert len(directories) == 2, "one directory fsync for the first write, one for the nineteen behind it"
    fresh = FileStore(tmp_path).for_owner(LOCAL_OWNER)
    assert [(await fresh.get(c["id"]))["title"] for c in convs] == ["first"] + ["rest"] * 19


async def test_a_failed_directory_fsync_fails_every_write_of_its_batch(tmp_path, monkeypatch):
    files = FileStore(tmp_path)
    store = files.for_owner(LOCAL_OWNER)
    conv = await store.create({"id": new_id(), "model": "m", "settings": {}})

    def no_directory_sync(directory):
        raise OSError("EIO")

    monkeypatch.setattr(storage, "fsync_directory", no_directory_sync)
    with pytest.raises(OSError, match="EIO"):
        await store.update(conv["id"], lambda c: c.update(title="lost?"))
    monkeypatch.undo()
    # Memory forgot the change it could not vouch for: the store reads the disk again.
    assert (await store.get(conv["id"]))["title"] == (json.loads(
        (files.conversations_dir / f"{conv['id']}.json").read_text())["title"])


async def test_a_slow_write_does_not_hold_up_another_conversations_write(tmp_path):
    """A burst of turns must not queue behind one disk flush at a time: another writer thread takes it."""
    files = FileStore(tmp_path)
    store = files.for_owner(LOCAL_OWNER)
    slow, quick = [await store.create({"id": new_id(), "model": "m", "settings": {}}) for _ in range(2)]
    loop = asyncio.get_running_loop()
    held, release = asyncio.Event(), threading.Event()

    def hold_the_slow_one(path, data):
        if path.name == f"{slow['id']}.json":
            loop.call_soon_threadsafe(held.set)
            release.wait(10)

    files.before_write = hold_the_slow_one
    try:
        stuck = asyncio.create_task(store.update(slow["id"], lambda c: c.update(title="slow")))
        await asyncio.wait_for(held.wait(), 10)
        await asyncio.wait_for(store.update(quick["id"], lambda c: c.update(title="quick")), 5)
        assert not stuck.done()
    finally:
        release.set()
    await stuck
    fresh = FileStore(tmp_path).for_owner(LOCAL_OWNER)
    assert [(await fresh.get(c["id"]))["title"] for c in (slow, quick)] == ["slow", "quick"]
