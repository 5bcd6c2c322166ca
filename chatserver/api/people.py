"""Routes for administrators to manage people (AUTH=password): list, add, reset a password,
promote or demote, remove. The command line (`server.py user ...`) stays; both go through the
account store, and removing a person removes their data the way the command line does
(`accounts/removal.py`).

Every route is 403 for anyone but an administrator (checked first, whatever the mode), then 404
unless AUTH=password. Nobody can remove or demote the last administrator (409, nothing changed):
the store counts and changes in one step. Password hashes never leave the server.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import Response
from pydantic import Field, StrictBool, StrictStr

from chatserver.accounts.auth import LOCAL_OWNER, MIN_PASSWORD_CHARS, Accounts, accounts
from chatserver.accounts.removal import remove_person_data
from chatserver.accounts.store import BadAccount, LastAdmin
from chatserver.api.deps import StateDep, UserDep
from chatserver.api.schemas import Strict

router = APIRouter(prefix="/api/people", tags=["people"])
ERRORS = {403: {"description": "not an administrator"}, 404: {"description": "no such person, or AUTH is not password"},
          409: {"description": "the last administrator cannot be removed or demoted"}}

Password = Annotated[StrictStr, Field(min_length=MIN_PASSWORD_CHARS, max_length=1000)]


class PersonCreate(Strict):
    name: StrictStr = Field(min_length=1, max_length=64)
    password: Password
    admin: StrictBool = False


class PasswordReset(Strict):
    password: Password


class PersonPatch(Strict):
    admin: StrictBool


async def people_admin(user: UserDep, request: Request) -> Accounts:
    """The accounts, for an administrator of a server that keeps passwords."""
    if not user.admin:
        raise HTTPException(403, "only an administrator may manage people")
    found = accounts(request.app)
    if found.settings.auth != "password":
        raise HTTPException(404, "people are managed here only with AUTH=password")
    return found


AccountsDep = Annotated[Accounts, Depends(people_admin)]


def person(record: dict) -> dict:
    """What the page is told of an account: never its hash, epoch or owner id."""
    return {"name": record["name"], "admin": bool(record.get("admin")), "created_at": record.get("created_at")}


async def _hash(found: Accounts, password: str) -> str:
    return await asyncio.to_thread(found.hasher.hash, password)  # argon2: 64 MiB and a while, off the loop


async def _record(found: Accounts, name: str) -> dict:
    record = await found.store.find_user(name)
    if record is None:
        raise HTTPException(404, f"there is no person named {name!r}")
    return record


@router.get("", responses=ERRORS)
async def list_people(found: AccountsDep) -> list[dict]:
    return [person(r) for r in await found.store.users()]


@router.post("", status_code=201, responses=ERRORS)
async def add_person(body: PersonCreate, found: AccountsDep) -> dict:
    try:
        return person(await found.store.add_user(body.name, await _hash(found, body.password), body.admin, time.time()))
    except BadAccount as exc:
        raise HTTPException(409 if "already" in str(exc) else 422, str(exc)) from None


@router.put("/{name}/password", status_code=204, responses=ERRORS)
async def reset_password(name: str, body: PasswordReset, found: AccountsDep) -> Response:
    """A new password; every session the person had ends."""
    record = await _record(found, name)
    await found.store.set_password(record["name"], await _hash(found, body.password))
    return Response(status_code=204)


@router.patch("/{name}", responses=ERRORS)
async def promote_or_demote(name: str, body: PersonPatch, found: AccountsDep) -> dict:
    record = await _record(found, name)
    try:
        return person(await found.store.set_admin(record["name"], body.admin))
    except LastAdmin as exc:
        raise HTTPException(409, str(exc)) from None


@router.delete("/{name}", status_code=204, responses=ERRORS)
async def remove_person(name: str, found: AccountsDep, state: StateDep) -> Response:
    """The account (its sessions end) and then all its data, as `server.py user remove` does."""
    record = await _record(found, name)
    try:
        removed = await found.store.remove_user(record["name"], keep_an_admin=True)
    except LastAdmin as exc:
        raise HTTPException(409, str(exc)) from None
    await stop_turns(state, removed["owner"])
    await remove_person_data(state.store, state.attachments, removed["owner"])
    if removed["owner"] != LOCAL_OWNER:
        shutil.rmtree(Path(state.settings.data_dir) / "users" / removed["owner"], ignore_errors=True)
    return Response(status_code=204)


async def stop_turns(state, owner: str) -> None:
    """A reply nobody can read any more must not go on being generated and billed."""
    for entry in await state.store.for_owner(owner).list():
        await state.hub.stop(entry["id"])
