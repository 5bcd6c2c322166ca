"""Routes for search, export and import: `GET /api/search`, `GET /api/conversations/{id}/export`,
and (not yet included) `POST /api/import`.

The search index is opened lazily by a dependency on first use; the first open brings it in line
with the store (`reconcile`), so a server that ran without it, or crashed before its last index
write, still finds everything. Conversations are read through the store of `app.state.chat`.

This module knows the HTTP contract of these routes; it does not know how conversations are
stored beyond the store's `get` and `list`, nor who an owner is (`owner_of` stands in for that).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Literal

import anyio
from fastapi import APIRouter, Depends, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response

import exchange
from search_index import SearchIndex
from storage import new_id, now_iso

log = logging.getLogger("chat.exchange")

INDEX_FILE = "search.sqlite3"
LOCAL_OWNER = "local"  # one person per server until the store is owner-scoped

router = APIRouter()


def owner_of(request: Request) -> str:
    """Whose conversations this request sees (one owner today)."""
    return LOCAL_OWNER


async def get_search_index(request: Request) -> SearchIndex:
    """The app's index, opened and reconciled with the store on first use."""
    app_state = request.app.state
    ready = getattr(app_state, "search_index_ready", None)
    if ready is None:
        ready = app_state.search_index_ready = asyncio.get_running_loop().create_future()
        try:
            index = SearchIndex(app_state.chat.settings.data_dir / INDEX_FILE)
            await index.open()
            owner = owner_of(request)
            pairs = [(owner, conv) for conv in app_state.chat.store.list()]
            if await index.is_built():
                await index.reconcile(pairs)
            else:
                await index.rebuild(pairs)
        except BaseException as exc:
            del app_state.search_index_ready  # the next request tries again
            ready.set_exception(exc)
            ready.exception()  # retrieved: this request reports it; later ones start afresh
            raise
        app_state.search_index = index
        ready.set_result(index)
    return await asyncio.shield(ready)


IndexDep = Annotated[SearchIndex, Depends(get_search_index)]
OwnerDep = Annotated[str, Depends(owner_of)]


@router.get("/api/search")
async def search(index: IndexDep, owner: OwnerDep,
                 q: Annotated[str, Query(min_length=1, max_length=200)],
                 limit: Annotated[int, Query(ge=1, le=100)] = 20) -> list[dict]:
    """The owner's best matches; each `snippet` is HTML whose only markup is <mark>."""
    return await index.search(owner, q, limit)


@router.get("/api/conversations/{conv_id}/export")
async def export_conversation(conv_id: str, request: Request,
                              format: Literal["json", "md"] = "json") -> Response:
    """The conversation as a download: this server's JSON envelope, or Markdown."""
    conv = request.app.state.chat.store.get(conv_id)
    if format == "md":
        body = exchange.export_markdown(conv).encode("utf-8")
        media = "text/markdown; charset=utf-8"
    else:
        body = await anyio.to_thread.run_sync(exchange.export_json, [(conv, None)])
        media = "application/json"
    name = exchange.safe_filename(conv.get("title", ""), format)
    return Response(body, media_type=media, headers={
        "Content-Disposition": exchange.content_disposition(name), "Cache-Control": "no-store"})


# Not included yet: storing a tree needs the branch data model and the owner-scoped store.
import_router = APIRouter()


@import_router.post("/api/import", status_code=201)
async def import_conversations(file: UploadFile, request: Request, owner: OwnerDep) -> Response:
    """Every conversation in the uploaded file, or 422 with the reason and nothing stored."""
    if file.size is not None and file.size > exchange.MAX_IMPORT_BYTES:
        return JSONResponse({"detail": f"the file is over {exchange.MAX_IMPORT_BYTES // 2**20} MB"}, status_code=422)
    raw = await file.read()
    try:
        imported = await anyio.to_thread.run_sync(exchange.parse_import, raw)
    except exchange.Unreadable as exc:
        return JSONResponse({"detail": f"the file cannot be imported: {exc.reason}"}, status_code=422)
    state = request.app.state.chat
    ids = []
    for conv in imported:
        created = await state.store.create(stored_conversation(conv, state))
        ids.append(created["id"])
    return JSONResponse({"imported": ids}, status_code=201)


def stored_conversation(conv: exchange.ImportedConversation, state) -> dict:
    """A new stored conversation from an imported tree (the branch fields are the coordinator's to settle)."""
    from server import default_settings  # the route module must not import server at import time

    messages, branches = exchange.from_tree(conv["nodes"], conv["current"])
    return {
        "id": new_id(), "title": conv["title"], "model": conv["model"] or state.settings.default_model,
        "created_at": conv["created_at"], "updated_at": now_iso(),
        "settings": default_settings(state.settings, None),
        "summary": conv.get("summary", ""),
        "messages": messages, "branches": branches, "all_messages": conv["nodes"],
        "archive": [{"id": new_id(), **m} for m in conv.get("archive", [])],
    }
