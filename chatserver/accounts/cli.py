"""`python server.py user add NAME [--admin] | passwd NAME | remove NAME [--yes] | list`: accounts for AUTH=password.

Edits the accounts where STORE keeps them: DATA_DIR/users.json (under the same lock a running
server uses) or the Redis at REDIS_URL; running servers pick changes up without a restart.
Passwords are asked twice on a terminal, or read as one line from stdin when it is not one
(scripts, tests). Changing a password or removing a user ends their sessions, in either store.
`remove` removes the person's data too (conversations with their files, library, memory,
presets, projects, shared links, search rows), after a yes on a terminal or with `--yes`
(`accounts/removal.py`, as the People routes do).
Knows nothing of HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import shutil
import sys
import time
from pathlib import Path

from argon2 import PasswordHasher
from pydantic import ValidationError

from chatserver.accounts.auth import LOCAL_OWNER, MIN_PASSWORD_CHARS
from chatserver.accounts.removal import remove_person_data
from chatserver.accounts.store import AccountStore, BadAccount
from chatserver.api.exchange import INDEX_FILE, SYNCED_INDEX_FILE
from chatserver.attachments.blobs import BlobsUnavailable
from chatserver.attachments.store import INDEX_FILE as PASSAGES_FILE
from chatserver.attachments.store import SearchIndex as PassageIndex
from chatserver.attachments.store import conversation_scope, library_scope
from chatserver.config import Settings, get_settings
from chatserver.search.index import SearchIndex
from chatserver.store.files import StoreUnavailable


def main(argv: list[str]) -> int:
    """Run one user command; 0 on success, 1 when it could not be done, 2 on a usage or settings error."""
    parser = argparse.ArgumentParser(prog="server.py user", description="Manage the accounts of AUTH=password.")
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("add", help="add a user (asks for the password)")
    add.add_argument("name")
    add.add_argument("--admin", action="store_true", help="may change the model lineup")
    commands.add_parser("passwd", help="set a new password (ends the user's sessions)").add_argument("name")
    remove = commands.add_parser("remove", help="remove a user and all their data, and end their sessions")
    remove.add_argument("name")
    remove.add_argument("--yes", action="store_true", help="do not ask: remove their data too")
    commands.add_parser("list", help="list the users")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) and 2
    try:
        settings = get_settings()
    except ValidationError as exc:
        print("configuration error:\n" + "\n".join(f"  {e['msg']}" for e in exc.errors()), file=sys.stderr)
        return 2
    password = None
    try:
        if args.command in ("add", "passwd"):
            password = _ask_password()  # before the store is opened: a refused password changes nothing
        return asyncio.run(_run(args, settings, password))
    except BadAccount as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except StoreUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace, settings: Settings, password: str | None) -> int:
    from chatserver.app import make_account_store, make_store

    store = make_store(settings)
    users: AccountStore | None = None
    try:
        await store.ping()
        users = make_account_store(settings, store)
        if args.command == "add":
            assert password is not None
            record = await users.add_user(args.name, PasswordHasher().hash(password), args.admin, time.time())
            print(f"added {record['name']}{' (admin)' if record['admin'] else ''}")
        elif args.command == "passwd":
            assert password is not None
            if await users.find_user(args.name) is None:
                raise BadAccount(f"there is no user named {args.name!r}")
            await users.set_password(args.name, PasswordHasher().hash(password))  # and ends their sessions
            print(f"changed the password of {args.name}; their sessions have ended")
        elif args.command == "remove":
            found = await users.find_user(args.name)
            if found is None:
                raise BadAccount(f"there is no user named {args.name!r}")
            record = found
            what = f"{record['name']} and all their data (conversations with their files, library, memory, presets)"
            if not args.yes and not _confirmed(f"Remove {what}? This cannot be undone. [y/N] "):
                raise BadAccount(f"nothing removed; to remove {what}, answer y on a terminal or add --yes")
            # The account (and its sessions) goes first, so nobody can add to the data while it is being removed.
            await users.remove_user(record["name"])
            try:
                count = await remove_data(settings, record["owner"])
            except (StoreUnavailable, BlobsUnavailable) as exc:
                print(f"error: removed the account {record['name']}, but not their data (owner "
                      f"{record['owner']}): the store is unreachable ({exc})", file=sys.stderr)
                return 1
            print(f"removed {record['name']} and their data: {count} conversations, their files, library, "
                  "memory and presets")
        else:
            for record in await users.users():
                flags = " admin" if record.get("admin") else ""
                print(f"{record['name']}{flags}  created {record['created_at']}")
    finally:
        if users is not None:
            await users.close()
        await store.close()
    return 0


def _confirmed(question: str) -> bool:
    """A yes typed on a terminal; never from a script's stdin (it says --yes)."""
    if not sys.stdin.isatty():
        return False
    return input(question).strip().lower() in ("y", "yes")


async def remove_data(settings: Settings, owner: str) -> int:
    """Delete everything `owner` has in the store, the blob store (S3) and under DATA_DIR; the number of conversations."""
    from chatserver.app import make_attachments, make_stores

    stores = make_stores(settings)
    store = stores.store
    # Their files where the server keeps them: metadata beside the conversations, originals in BLOB_STORE.
    attachments = make_attachments(settings, stores.shared)
    try:
        conv_ids = await remove_person_data(store, attachments, owner)
        # The server's own indexes, and each WORKERS process's (SEARCH_INDEX_DIR/worker-N); the
        # attachments' passages in the server's own went with delete_scope above.
        scopes = [conversation_scope(conv_id) for conv_id in conv_ids] + [library_scope(owner)]
        for directory in (settings.index_dir, *sorted(settings.index_dir.glob("worker-*"))):
            for name in (INDEX_FILE, SYNCED_INDEX_FILE):
                await _forget_in_index(directory / name, owner, conv_ids)
            if directory != settings.index_dir and (directory / PASSAGES_FILE).exists():
                passages = PassageIndex(directory / PASSAGES_FILE)
                for scope in scopes:
                    await asyncio.to_thread(passages.remove, scope)
                passages.close()
    finally:
        await attachments.close()
        await store.close()
    if owner != LOCAL_OWNER:  # an account's own folder (the local person's files are the ones above)
        shutil.rmtree(Path(settings.data_dir) / "users" / owner, ignore_errors=True)
    return len(conv_ids)


async def _forget_in_index(path: Path, owner: str, conv_ids: list[str]) -> None:
    """Drop the conversations' rows from a search index file, if there is one."""
    if not path.exists():
        return
    index = SearchIndex(path)
    try:
        for conv_id in conv_ids:
            await index.remove_conversation(owner, conv_id)
    finally:
        await index.close()


def _ask_password() -> str:
    if sys.stdin.isatty():
        password = getpass.getpass("Password: ")
        if getpass.getpass("Repeat it: ") != password:
            raise BadAccount("the two passwords differ")
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    if len(password) < MIN_PASSWORD_CHARS:
        raise BadAccount(f"a password needs at least {MIN_PASSWORD_CHARS} characters")
    return password
