"""`python server.py user add NAME [--admin] | passwd NAME | remove NAME | list`: accounts for AUTH=password.

Edits DATA_DIR/users.json (under the same lock a running server uses, which picks changes up
without a restart). Passwords are asked twice on a terminal, or read as one line from stdin when
it is not one (scripts, tests). Knows nothing of HTTP.
"""

from __future__ import annotations

import argparse
import getpass
import sys
import time

from argon2 import PasswordHasher
from pydantic import ValidationError

from auth import MIN_PASSWORD_CHARS, BadAccount, UserFile, remove_sessions_of
from config import get_settings


def main(argv: list[str]) -> int:
    """Run one user command; 0 on success, 1 when it could not be done, 2 on a usage or settings error."""
    parser = argparse.ArgumentParser(prog="server.py user", description="Manage the accounts of AUTH=password.")
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("add", help="add a user (asks for the password)")
    add.add_argument("name")
    add.add_argument("--admin", action="store_true", help="may change the model lineup")
    commands.add_parser("passwd", help="set a new password (ends the user's sessions)").add_argument("name")
    commands.add_parser("remove", help="remove a user and end their sessions").add_argument("name")
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
    users = UserFile(settings.data_dir)
    try:
        if args.command == "add":
            record = users.add(args.name, PasswordHasher().hash(_ask_password()), args.admin, time.time())
            print(f"added {record['name']}{' (admin)' if record['admin'] else ''}")
        elif args.command == "passwd":
            if users.find(args.name) is None:
                raise BadAccount(f"there is no user named {args.name!r}")
            users.set_password(args.name, PasswordHasher().hash(_ask_password()))
            remove_sessions_of(settings.data_dir, args.name)
            print(f"changed the password of {args.name}; their sessions have ended")
        elif args.command == "remove":
            record = users.remove(args.name)
            remove_sessions_of(settings.data_dir, record["name"])
            print(f"removed {record['name']}")
        else:
            for record in users.load()["users"]:
                flags = " admin" if record.get("admin") else ""
                print(f"{record['name']}{flags}  created {record['created_at']}")
    except BadAccount as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


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
