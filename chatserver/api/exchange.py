"""Routes for search, export and import: `GET /api/search`, `GET /api/conversations/{id}/export`,
`POST /api/import`.

Search reads the index `search/follow.py` keeps in step with the store's changes (any process's).
Conversations are read and made through the owner-scoped store, like every other route.
"""

from __future__ import annotations

import logging
import os
import zipfile
from typing import Annotated, Literal

import anyio
from fastapi import APIRouter, Depends, HTTPException, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response

from chatserver.api.deps import OwnerStoreDep, StateDep
from chatserver.api.quota import check_conversations, check_files
from chatserver.attachments.store import AttachmentError, Attachments, Scope, conversation_scope, public
from chatserver.conversations import exchange, pii
from chatserver.conversations.document import new_id, now_iso
from chatserver.search.follow import FollowedSearch
from chatserver.store.files import OwnerStore

log = logging.getLogger("chat.exchange")

INDEX_FILE = "search.sqlite3"
SYNCED_INDEX_FILE = "search-redis.sqlite3"  # never the file store's: switching STORE starts afresh
MAX_IMPORT_IMAGES = 500  # images of one zip kept as attachments; each is read in the limited child

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
async def export_conversation(conv_id: str, store: OwnerStoreDep, state: StateDep,
                              format: Literal["json", "md"] = "json") -> Response:
    """The conversation as a download: this server's JSON envelope, or Markdown."""
    conv = await store.get(conv_id)
    if format == "md":
        files = {m["id"]: public(m) for m in await state.attachments.list(conversation_scope(conv_id))}
        body = exchange.export_markdown(conv, files).encode("utf-8")
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
    images = ZipImages(raw, state.attachments, store)
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
        await images.attach(created)
    warnings += images.warnings()
    return JSONResponse({"imported": ids, "warnings": warnings}, status_code=201)


class ZipImages:
    """The images of a ChatGPT zip download, kept as attachments of the conversations whose
    messages showed them (issue 24 with issue 25's images).

    Each goes through the upload's own path (`Attachments.ingest`: MAX_ATTACHMENT_BYTES, the limited
    child, MAX_IMAGE_PIXELS, metadata stripped, QUOTA_FILE_BYTES), read from the archive in memory
    within MAX_ATTACHMENT_BYTES whatever its header declares, and at most MAX_IMPORT_IMAGES per
    import. A message's images become its `attachment_ids` and leave its text ("[image]" marks
    remain only for images that could not be kept); images left out are counted in one warning.
    """

    def __init__(self, raw: bytes, attachments: Attachments, store: OwnerStore) -> None:
        self.raw = raw
        self.attachments = attachments
        self.store = store
        self.members, self.names = exchange.zip_images(raw)
        self.kept: set[str] = set()  # member names stored
        self.refused: list[str] = []  # why some were not

    async def attach(self, conv: dict) -> None:
        messages = [m for key in ("archive", "messages", "off_path") for m in conv.get(key) or []]
        wanted = [m for m in messages if m.get("image_refs")]
        if not wanted:
            return
        scope = conversation_scope(conv["id"])
        stored: dict[str, str] = {}  # asset id -> attachment id, in this conversation
        for message in wanted:
            for asset in message["image_refs"]:
                if asset in stored or asset not in self.members or len(self.kept) >= MAX_IMPORT_IMAGES:
                    continue
                attachment_id = await self._ingest(scope, self.members[asset])
                if attachment_id is not None:
                    stored[asset] = attachment_id

        def link(doc: dict) -> None:
            for key in ("archive", "messages", "off_path"):
                for m in doc.get(key) or []:
                    refs = m.pop("image_refs", None)
                    ids = [stored[a] for a in refs or [] if a in stored]
                    if ids:
                        m["attachment_ids"] = list(dict.fromkeys(ids))
                        m["content"] = exchange.without_image_marks(m["content"], len(ids))

        await self.store.update(conv["id"], link)

    async def _ingest(self, scope: Scope, info: zipfile.ZipInfo) -> str | None:
        name = info.filename.rsplit("/", 1)[-1]
        try:
            data = await anyio.to_thread.run_sync(exchange.zip_member, self.raw, info,
                                                  self.attachments.limits.max_bytes)
        except exchange.Unreadable as exc:
            self.refused.append(f"{name}: {exc.reason}")
            return None
        fd, path = self.attachments.incoming_file()
        with os.fdopen(fd, "wb") as f:
            await anyio.to_thread.run_sync(f.write, data)
        del data

        async def fits(size: int) -> None:
            await check_files(self.attachments, self.store, size)

        try:
            meta = await self.attachments.ingest(scope, name, path, self.store.owner, fits)
        except AttachmentError as exc:
            self.refused.append(f"{name}: {exc}")
            return None
        except HTTPException as exc:  # the quota
            self.refused.append(f"{name}: {exc.detail}")
            return None
        finally:
            path.unlink(missing_ok=True)
        self.kept.add(info.filename)
        return meta["id"]

    def warnings(self) -> list[dict]:
        left = len(self.names - self.kept)
        if not left:
            return []
        why = f" Not kept: {'; '.join(self.refused[:3])}{'; …' if len(self.refused) > 3 else ''}." \
            if self.refused else ""
        return [{"code": "images_skipped", "count": left,
                 "message": f"{left} {'image' if left == 1 else 'images'} of the archive {'was' if left == 1 else 'were'} "
                            f"not imported (no message showed {'it' if left == 1 else 'them'}, or "
                            f"{'it' if left == 1 else 'they'} could not be kept).{why}"}]


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
