"""Routes for shared read-only copies (`conversations/sharing.py`): made, listed and revoked by
their owner; read by anyone with the link, without an account, at `/s/{id}` (a page) and
`/api/shared/{id}` (its JSON).

The shared page is built here from escaped text: it carries no script at all, so nothing a
conversation holds can run on it, and the Content-Security-Policy every answer carries stays.
It asks not to be indexed (`X-Robots-Tag` and the robots meta) and is never cached by proxies.
With ALLOW_SHARING=false the owner's routes are 403 and the links 404.
"""

from __future__ import annotations

import html
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import StrictBool

from chatserver.api.deps import OwnerStoreDep, StateDep
from chatserver.api.schemas import Strict
from chatserver.attachments.store import conversation_scope
from chatserver.conversations.sharing import Shares, TooManyShares, read_snapshot
from chatserver.store.files import NotFound

router = APIRouter(tags=["sharing"])

READER_HEADERS = {"X-Robots-Tag": "noindex, nofollow", "Cache-Control": "private, no-store",
                  "Referrer-Policy": "no-referrer"}
GONE = "this shared link does not exist or was revoked"


class ShareCreate(Strict):
    attachments: StrictBool = False  # show the names of the files messages were about
    costs: StrictBool = False  # show each reply's tokens and cost


async def sharing_allowed(state: StateDep) -> None:
    if not state.settings.allow_sharing:
        raise HTTPException(403, "sharing is turned off on this server (ALLOW_SHARING=false)")


async def get_shares(state: StateDep, store: OwnerStoreDep, _: Annotated[None, Depends(sharing_allowed)]) -> Shares:
    return Shares(state.store, store)


SharesDep = Annotated[Shares, Depends(get_shares)]


def link(entry: dict) -> dict:
    return {**entry, "url": f"/s/{entry['id']}"}


@router.post("/api/conversations/{conv_id}/share", status_code=201)
async def share_conversation(conv_id: str, shares: SharesDep, store: OwnerStoreDep, state: StateDep,
                             body: ShareCreate | None = None) -> dict:
    """Snapshot the conversation's current path at a new, unguessable link: 201 with the link's entry."""
    body = body or ShareCreate()
    conv = await store.get(conv_id)  # the owner check: another person's id is 404
    names = None
    if body.attachments:
        names = {m["id"]: m["name"] for m in await state.attachments.list(conversation_scope(conv_id))}
    try:
        return link(await shares.create(conv, costs=body.costs, file_names=names))
    except TooManyShares as exc:
        raise HTTPException(413, str(exc)) from None


@router.get("/api/shares")
async def list_shares(shares: SharesDep) -> list[dict]:
    return [link(entry) for entry in await shares.list()]


@router.delete("/api/shares/{share_id}", status_code=204)
async def revoke_share(share_id: str, shares: SharesDep) -> Response:
    try:
        await shares.revoke(share_id)
    except NotFound:
        return JSONResponse({"detail": "no such shared link"}, status_code=404)
    return Response(status_code=204)


async def _snapshot(state: StateDep, share_id: str) -> dict:
    try:
        if not state.settings.allow_sharing:
            raise NotFound(share_id)
        snapshot = await read_snapshot(state.store, share_id)
    except NotFound:
        raise HTTPException(404, GONE, headers=READER_HEADERS) from None
    snapshot.pop("owner", None)  # whose it is is nobody else's business
    return snapshot


@router.get("/api/shared/{share_id}")
async def read_shared(share_id: str, state: StateDep) -> JSONResponse:
    """The shared copy as JSON, for anyone with the link."""
    return JSONResponse(await _snapshot(state, share_id), headers=READER_HEADERS)


@router.get("/s/{share_id}", include_in_schema=False)
async def shared_page(share_id: str, state: StateDep) -> HTMLResponse:
    try:
        snapshot = await _snapshot(state, share_id)
    except HTTPException:
        return HTMLResponse(render_page("Not found", [f'<p class="gone">{html.escape(GONE)}.</p>']),
                            status_code=404, headers=READER_HEADERS)
    return HTMLResponse(render_page(snapshot["title"], render_messages(snapshot)), headers=READER_HEADERS)


def render_messages(snapshot: dict) -> list[str]:
    """Every message as escaped text in its own block: nothing in it becomes markup."""
    e = html.escape
    parts = [f'<p class="meta">Shared {e(snapshot["created_at"][:10])} · {e(snapshot.get("model") or "")} · '
             "a read-only copy</p>"]
    for m in snapshot["messages"]:
        who = "You" if m["role"] == "user" else e(m.get("model") or "Assistant")
        lines = [f'<article class="msg {e(m["role"])}" data-role="{e(m["role"])}">', f'<h2>{who}</h2>',
                 f'<div class="text">{e(m["content"])}</div>']
        if m.get("files"):
            lines.append(f'<p class="files">Files: {e(", ".join(m["files"]))}</p>')
        sources = [c for c in m.get("citations") or [] if c.get("url") or c.get("name")]
        if sources:
            shown = [f'{c.get("title") or c["url"]} ({c["url"]})' if c.get("url") else f'{c["name"]} {c.get("label", "")}'
                     for c in sources]
            lines.append(f'<p class="sources">Sources: {e("; ".join(shown))}</p>')
        if m.get("usage"):
            u = m["usage"]
            cost = f" · ${u['cost']:.4f}" if isinstance(u.get("cost"), (int, float)) else ""
            lines.append(f'<p class="usage">{u.get("input_tokens") or 0:,} in · {u.get("output_tokens") or 0:,} out'
                         f'{e(cost)}</p>')
        if m.get("status") == "interrupted":
            lines.append('<p class="usage">(interrupted)</p>')
        lines.append("</article>")
        parts.append("\n".join(lines))
    return parts


def render_page(title: str, body: list[str]) -> str:
    return "\n".join([
        "<!doctype html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<meta name="robots" content="noindex, nofollow">', '<meta name="referrer" content="no-referrer">',
        f"<title>{html.escape(title)}</title>", '<link rel="icon" href="data:,">',
        '<link rel="stylesheet" href="/static/shared.css">', "</head>", '<body class="shared">',
        f'<main><h1 id="shared-title">{html.escape(title)}</h1>', *body, "</main>", "</body>", "</html>", "",
    ])
