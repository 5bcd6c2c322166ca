"""`python server.py migrate`: files → Redis → files gives back the same conversations, memories
and models, byte for byte where nothing was sealed; running it again duplicates nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import redis as sync_redis

from chatserver.conversations.presets import Presets
from chatserver.costs.ledger import FileLedger, RedisLedger
from chatserver.store.files import SEAL_AFTER, FileStore
from chatserver.store.redis import RedisStore
from redis_support import unique_prefix
from test_store_contract import append, conversation, message

ROOT = Path(__file__).resolve().parent.parent


def run_migrate(*args: str) -> str:
    done = subprocess.run([sys.executable, "server.py", "migrate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


async def make_source(data_dir: Path) -> FileStore:
    files = FileStore(data_dir)
    alice, bob = files.for_owner("local"), files.for_owner("bob")
    short = await alice.create(conversation(title="짧은 대화", totals={"cost": 0.125}))
    for i in range(3):
        await alice.update(short["id"], append(message(f"질문 {i} 🙂")))
    await alice.update(short["id"], lambda c: c.update(archive=[message("folded")], summary="요약"))
    await bob.create(conversation(title="empty"))
    long = await bob.create(conversation(title="long"))
    await bob.update(long["id"], lambda c: c["messages"].extend(message(f"m{i}") for i in range(SEAL_AFTER + 7)))
    await alice.write_memory("이름: 민수\n")
    await bob.write_memory("likes tea")
    await Presets(bob, ["remember"]).create("Tea", "You know tea.", ["remember"])
    await Presets(files.for_owner("carol"), []).create("Only presets", "Carol has nothing else.", [])
    await files.write_custom_models([{"id": "mine", "tier": "fast"}])
    ledger = FileLedger(data_dir)  # issue 28: spend and its settings move with the conversations
    for month, cost in (("2026-11", 0.5), ("2026-12", None)):
        await ledger.put("bob", {"id": f"{month}.charge", "owner": "bob", "at": f"{month}-03T10:00:00+00:00",
                                 "conversation": long["id"], "message": None, "model": "mine", "kind": "reply",
                                 "turn": True, "input_tokens": 10, "cached_tokens": 0, "cache_write_tokens": 0,
                                 "output_tokens": 2, "cost": cost, "source": "reported" if cost else "unreported",
                                 "generation": None, "request": None})
    await ledger.write_setting("budgets", {"bob": 5.0})
    await files.flush()
    assert (data_dir / "conversations" / f"{long['id']}.earlier").is_dir()  # the long one is sealed
    return files


async def test_round_trip_files_redis_files(tmp_path, redis_server):
    source_dir, back_dir = tmp_path / "source", tmp_path / "back"
    source = await make_source(source_dir)
    before = {path.name: path.read_bytes() for path in (source_dir / "conversations").glob("*.json")}
    prefix = unique_prefix()
    redis_args = ["--redis-url", redis_server.url, "--redis-prefix", prefix]

    out = run_migrate("--from", "files", "--to", "redis", "--data-dir", str(source_dir), *redis_args)
    assert "3 conversations, 2 memories, 2 presets, 1 custom models" in out and "2 charges" in out
    r = sync_redis.Redis.from_url(redis_server.url)
    keys_once = sorted(r.scan_iter(match=f"{prefix}*"))
    lengths_once = {k: r.llen(k) for k in keys_once if k.endswith(b":messages")}
    run_migrate("--from", "files", "--to", "redis", "--data-dir", str(source_dir), *redis_args)
    keys_twice = sorted(r.scan_iter(match=f"{prefix}*"))
    assert keys_twice == keys_once
    assert {k: r.llen(k) for k in keys_twice if k.endswith(b":messages")} == lengths_once
    r.close()
    store = RedisStore(redis_server.url, prefix=prefix)
    assert len(await store.for_owner("bob").list()) == 2
    ledger = RedisLedger(store.redis, prefix)
    assert await ledger.months("bob") == ["2026-11", "2026-12"]
    assert await ledger.month_spent("bob", "2026-11") == 0.5  # twice migrated, counted once
    await store.close()

    run_migrate("--from", "redis", "--to", "files", "--data-dir", str(back_dir), *redis_args)
    run_migrate("--from", "redis", "--to", "files", "--data-dir", str(back_dir), *redis_args)
    back = FileStore(back_dir)
    assert sorted(c["id"] for c in back.load_all()) == sorted(c["id"] for c in source.load_all())
    for conv in FileStore(source_dir).load_all():
        assert back.load(conv["id"]) == conv
        if len(conv["messages"]) < SEAL_AFTER:
            name = f"{conv['id']}.json"
            assert (back_dir / "conversations" / name).read_bytes() == before[name]
    for relative in ("memory.md", "users/bob/memory.md", "users/bob/presets.json", "users/carol/presets.json",
                     "models.json"):
        assert (back_dir / relative).read_bytes() == (source_dir / relative).read_bytes()
    assert sorted(p.name for p in (back_dir / "conversations").glob("*.json")) == sorted(before)
    source_ledger, back_ledger = FileLedger(source_dir), FileLedger(back_dir)
    for month in ("2026-11", "2026-12"):
        assert await back_ledger.month("bob", month) == await source_ledger.month("bob", month)
    assert await back_ledger.read_setting("budgets") == {"bob": 5.0}


def test_bad_arguments_change_nothing(tmp_path):
    done = subprocess.run([sys.executable, "server.py", "migrate", "--from", "files", "--to", "files",
                           "--data-dir", str(tmp_path / "d")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "same store" in done.stderr
    assert not (tmp_path / "d").exists()


def test_redis_unreachable_is_reported_and_changes_nothing(tmp_path):
    done = subprocess.run([sys.executable, "server.py", "migrate", "--from", "redis", "--to", "files",
                           "--data-dir", str(tmp_path / "d"), "--redis-url", "redis://127.0.0.1:1/0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Redis at redis://127.0.0.1:1/0 is unreachable" in done.stderr
    assert not (tmp_path / "d").exists()
