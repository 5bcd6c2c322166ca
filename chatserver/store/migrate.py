"""`python server.py migrate --from files --to redis` (or back): copy every conversation (each
owner's), every owner's memory and documents (presets, projects, shares), the shared snapshots and
the custom models from one store to the other.

The copy is whole and repeatable: a conversation already in the target is replaced by the source's,
never duplicated, and the source is left as it was. Conversations the target has and the source
does not are left alone. A damaged conversation file is reported and skipped, as the server does.
Users and sessions are copied too (`migrate_accounts`): each session keeps its digest and the time
it has left.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

from chatserver.attachments.blobs import BlobMissing, Blobs, BlobsUnavailable, FileBlobs
from chatserver.attachments.meta import AttachmentMeta, FileMeta, RedisMeta
from chatserver.attachments.store import AttachmentNotFound, scope_of_key
from chatserver.conversations.document import valid_id
from chatserver.costs.ledger import FileLedger, Ledger, RedisLedger, copy_ledger
from chatserver.store.files import OWNER_DOCUMENTS, FileStore, Store
from chatserver.store.redis import RedisStore, StoreUnavailable

log = logging.getLogger("chat.migrate")

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


async def migrate(source: Store, target: Store) -> dict[str, int]:
    """Copy everything from `source` to `target`; how many of each kind were copied."""
    # In the order the summary line has always named them, the newer kinds after.
    copied = {"conversations": 0, "memories": 0, "presets": 0, "custom_models": 0, "projects": 0, "shares": 0,
              "shared_snapshots": 0}
    seen = set()
    async for conv in source.every_conversation():
        await target.for_owner(conv["owner"]).create(conv)
        seen.add(conv["owner"])
        copied["conversations"] += 1
    for owner in sorted(seen | await source.owners()):
        text = await source.for_owner(owner).read_memory()
        if text:  # an empty memory is the same as none: do not create files for it
            await target.for_owner(owner).write_memory(text)
            copied["memories"] += 1
        for kind in OWNER_DOCUMENTS:
            document = await source.for_owner(owner).read_document(kind)
            if document is not None:
                await target.for_owner(owner).update_document(kind, _replaced_by(document))
                copied[kind] += 1
    async for share_id, snapshot in source.every_share():
        await target.write_share(share_id, snapshot)
        copied["shared_snapshots"] += 1
    models = await source.read_custom_models()
    if models:
        await target.write_custom_models(models)
        copied["custom_models"] = len(models)
    servers = await source.read_mcp_servers()
    if servers:
        await target.write_mcp_servers(servers)
    await target.flush()
    return copied


def _replaced_by(document: bytes) -> Callable[[bytes | None], bytes]:
    """A document change that writes `document` whatever was there (mypy cannot type the lambda
    with a default argument this was)."""
    def change(_: bytes | None) -> bytes:
        return document
    return change


def open_store(kind: str, args: argparse.Namespace) -> Store:
    if kind == "files":
        return FileStore(args.data_dir)
    return RedisStore(args.redis_url, prefix=args.redis_prefix)


async def run(args: argparse.Namespace) -> dict[str, int]:
    opened: dict[str, Store] = {}
    try:
        # Redis first, and checked before the file store's directory is made: a failed run leaves no trace.
        for kind in ("redis", "files"):
            opened[kind] = store = open_store(kind, args)
            await store.ping()
        copied = await migrate(opened[args.source], opened[args.target])
        copied["attachments"] = await migrate_attachments_between(args)
        copied.update(await migrate_accounts(args, opened))
        copied["charges"] = await copy_ledger(*(ledger_of(opened[kind], args) for kind in (args.source, args.target)))
        return copied
    finally:
        for store in opened.values():
            await store.close()


def ledger_of(store: Store, args: argparse.Namespace) -> Ledger:
    """The person's ledger kept beside the conversations of `store` (issue 28)."""
    if isinstance(store, RedisStore):
        return RedisLedger(store.redis, store.prefix, store.reachable)
    return FileLedger(args.data_dir)


def default_data_dir() -> Path:
    from chatserver.config import get_settings

    return get_settings().data_dir


async def migrate_attachments(source: AttachmentMeta, source_blobs: Blobs,
                              target: AttachmentMeta, target_blobs: Blobs) -> int:
    """Copy every attachment's metadata, pages and original from one pair of stores to the other,
    byte for byte; how many were copied. Like the conversations: repeatable (an attachment already
    there is replaced), the source left as it was. The original goes first and the metadata last,
    as an upload does, so the target never lists a file without its bytes. An attachment whose
    original is missing from the source is reported and skipped; when both sides keep originals in
    the same place (BLOB_STORE=files on one DATA_DIR) they are left where they are."""
    same_place = source_blobs.where == target_blobs.where
    copied = 0
    async for key in source.scope_keys():
        try:
            scope = scope_of_key(key)
        except (AttachmentNotFound, ValueError):
            log.warning("skipping attachments under %r: not a conversation or library", key)
            continue
        for meta in (await source.list_many([scope.key]))[scope.key]:
            if not valid_id(meta.get("id", "")):
                log.warning("skipping an attachment under %s: its id is not one this server makes", scope.key)
                continue
            pages = await source.pages(scope.key, meta["id"])
            if pages is None:
                continue  # deleted meanwhile
            if not same_place:
                try:
                    blob = await source_blobs.open(scope.key, meta["id"])
                except BlobMissing:
                    log.error("skipping attachment %s/%s: its original is missing", scope.key, meta["id"])
                    continue
                with tempfile.TemporaryDirectory(prefix="migrate-") as tmp:
                    copy = Path(tmp) / "original"
                    try:
                        with open(copy, "wb") as out:
                            async for chunk in blob.chunks:
                                out.write(chunk)
                    finally:
                        await blob.aclose()
                    await target_blobs.put(scope.key, meta["id"], copy)
            await target.put(scope.key, meta, pages)
            copied += 1
    return copied


async def migrate_attachments_between(args: argparse.Namespace) -> int:
    """The attachments between the file store under `--data-dir` (metadata and originals there)
    and Redis (metadata beside the conversations, originals in the configured BLOB_STORE)."""
    from chatserver.app import make_blobs
    from chatserver.config import get_settings

    redis = RedisStore(args.redis_url, prefix=args.redis_prefix)
    root = args.data_dir / "attachments"
    sides: dict[str, tuple[AttachmentMeta, Blobs]] = {
        "files": (FileMeta(root), FileBlobs(root)),
        "redis": (RedisMeta(redis), make_blobs(get_settings())),
    }
    try:
        for _, blobs in sides.values():
            await blobs.start()
        return await migrate_attachments(*sides[args.source], *sides[args.target])
    finally:
        for _, blobs in sides.values():
            await blobs.close()
        await redis.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="server.py migrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", choices=("files", "redis"), required=True)
    parser.add_argument("--to", dest="target", choices=("files", "redis"), required=True)
    parser.add_argument("--data-dir", type=Path, help="the file store's directory (default: DATA_DIR)")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
                        help="the Redis store (default: REDIS_URL)")
    parser.add_argument("--redis-prefix", default="chat:", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.source == args.target:
        parser.error("--from and --to name the same store")
    if args.data_dir is None:
        args.data_dir = default_data_dir()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        copied = asyncio.run(run(args))
    except (StoreUnavailable, BlobsUnavailable) as exc:
        print(f"migrate: {exc}", file=sys.stderr)
        return 1
    print(f"copied from {args.source} to {args.target}: " + ", ".join(f"{n} {k.replace('_', ' ')}"
                                                                    for k, n in copied.items()))
    return 0


async def migrate_accounts(args: argparse.Namespace, opened: dict[str, Store]) -> dict[str, int]:
    """Copy users and sessions beside the conversations of each store, where the server keeps them
    (the account stores are the ones `app.make_account_store` picks for the server)."""
    from chatserver.app import make_account_store
    from chatserver.config import get_settings

    base = get_settings()  # SESSION_HOURS: what a file store's session has left
    source, target = (make_account_store(base.model_copy(update={"store": kind, "data_dir": args.data_dir}),
                                         opened[kind]) for kind in (args.source, args.target))
    try:
        dump = await source.export_accounts()
        await target.import_accounts(dump)
    finally:
        await source.close()
        await target.close()
    return {"users": len(dump.users), "sessions": len(dump.sessions)}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
