"""Routes for search, export and import: `GET /api/search`, `GET /api/conversations/{id}/export`,
`POST /api/import`.

Search reads the index `search/follow.py` keeps in step with the store's changes (any process's).
Conversations are read and made through the owner-scoped store, like every other route.
"""

from __future__ import annotations

import logging
from typing import Annotated, Literal

import anyio
from fastapi import APIRouter, Depends, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response

from chatserver.api.deps import OwnerStoreDep, StateDep
from chatserver.api.quota import check_conversations
from chatserver.conversations import exchange, pii
from chatserver.conversations.document import new_id, now_iso
from chatserver.search.follow import FollowedSearch

log = logging.getLogger("chat.exchange")

INDEX_FILE = "search.sqlite3"
SYNCED_INDEX_FILE = "search-redis.sqlite3"  # never the file store's: switching STORE starts afresh

router = APIRouter()


def get_search(request: Request) -> FollowedSearch:
    return request.app.state.search


SearchDep = Annotated[FollowedSearch, Depends(get_search)]


@router.get("/api/search")
async def search(searcher: SearchDep, store: OwnerStoreDep,
                 q: Annotated[str, Query(min_length=1, max_length=200)],
                 limit: Annotated[int, Query(ge=1, le=100)] = 20) -> list[dict]:
    """The owner's best matches; each `snippet` is HTML whose only markup is <mark>."""
    return await searcher.search(store, q, limit)


@router.get("/api/conversations/{conv_id}/export")
async def export_conversation(conv_id: str, store: OwnerStoreDep,
                              format: Literal["json", "md"] = "json") -> Response:
    """The conversation as a download: this server's JSON envelope, or Markdown."""
    conv = await store.get(conv_id)
    if format == "md":
        body = exchange.export_markdown(conv).encode("utf-8")
        media = "text/markdown; charset=utf-8"
    else:
        body = await anyio.to_thread.run_sync(exchange.export_json, [(conv, None)])
        media = "application/json"
    name = exchange.safe_filename(conv.get("title", ""), format)
    return Response(body, media_type=media, headers={
        "Content-Disposition": exchange.content_disposition(name), "Cache-Control": "no-store"})


@router.post("/api/import", status_code=201)
async def import_conversations(file: UploadFile, state: StateDep, store: OwnerStoreDep) -> Response:
    """Every conversation of the uploaded file that can be read (the others named in `warnings`),
    or 422 with the reasons and nothing stored when none can."""
    from chatserver.api.conversations import default_settings

    if file.size is not None and file.size > exchange.MAX_IMPORT_BYTES:
        return JSONResponse({"detail": f"the file is over {exchange.MAX_IMPORT_BYTES // 2**20} MB"}, status_code=422)
    raw = await file.read()
    try:
        result = await anyio.to_thread.run_sync(exchange.read_import, raw)
    except exchange.Unreadable as exc:
        return JSONResponse({"detail": f"the file cannot be imported: {exc.reason}", "warnings": exc.skipped},
                            status_code=422)
    imported = result["conversations"]
    lineup = {m.id for m in await state.lineup()}
    await check_conversations(state.settings.quota_conversations, store, len(imported))
    ids, warnings = [], list(result["warnings"])
    settings = await default_settings(state.settings, None, store)
    for conv in imported:
        replaced = model_replaced(conv["model"], lineup, state.settings.default_model)
        stored = stored_conversation(conv, state, settings, replaced)
        if state.settings.pii_masking == "on":
            await anyio.to_thread.run_sync(pii.mask_conversation, stored)
        created = await store.create(stored)
        ids.append(created["id"])
        if replaced:
            warnings.append({"id": created["id"], "code": "model_replaced", "message": replaced})
        warnings += [{"id": created["id"], **note} for note in conv.get("notes", [])]
    return JSONResponse({"imported": ids, "warnings": warnings}, status_code=201)


def model_replaced(model: str | None, lineup: set[str], default: str) -> str | None:
    """What to tell the person when an imported conversation's model cannot answer here (None: it can,
    or the file named none): only the lineup's models go upstream, so it gets the default."""
    if model is None or model in lineup:
        return None
    return (f"This conversation was made with {exchange.one_line(model)[:200]}, which is not in this server's "
            f"model lineup: it answers with {default} (change it in the model picker).")


def stored_conversation(conv: exchange.ImportedConversation, state, settings: dict,
                        replaced: str | None = None) -> dict:
    """A new stored conversation from an imported tree, in the store's branch model (branches.py):
    the current path in `archive` (what the export said compression had folded) and `messages`,
    every other branch in `off_path`. `replaced`: the notice saying its model was replaced by the
    default one, put at the end of the path; `settings`, a new conversation's (`default_settings`)."""
    nodes = [dict(n) for n in conv["nodes"]]
    path = exchange.current_path(nodes, conv["current"])
    folded = set(conv.get("folded", []))
    cut = next((i for i, n in enumerate(path) if n["id"] not in folded), len(path))
    archive, messages = path[:cut], path[cut:]
    if conv.get("archive"):
        # An older export's folded messages: the path before the tree's first message.
        archive, previous = [], None
        for m in conv["archive"]:
            archive.append({"id": new_id(), **m, "parent_id": previous})
            previous = archive[-1]["id"]
        for n in nodes:
            if n["parent_id"] is None:
                n["parent_id"] = previous
    on_path = {n["id"] for n in path}
    summary = conv.get("summary", "")
    if replaced:
        leaf = (path or archive or [{"id": None}])[-1]["id"]
        messages = messages + [{"id": new_id(), "role": "notice", "content": replaced, "created_at": now_iso(),
                                "parent_id": leaf}]
    return {
        "id": new_id(), "title": conv["title"], "title_source": "imported",
        "model": conv["model"] if conv["model"] and not replaced else state.settings.default_model,
        "created_at": conv["created_at"], "updated_at": now_iso(),
        # The system messages the file had replace the default persona; without any it is kept.
        "settings": {**settings, **({"system_prompt": conv["system_prompt"]} if conv.get("system_prompt") else {})},
        "summary": summary,
        "messages": messages, "archive": archive,
        "off_path": [n for n in nodes if n["id"] not in on_path],
        "folds": [{"through": archive[-1]["id"], "summary": summary}] if archive else [],
    }
