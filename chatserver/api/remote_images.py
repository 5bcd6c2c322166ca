"""An image a reply links to (`![alt](https://...)`), fetched by this server when the person asks.

The page never loads a reply's image from its own address: that request would tell the image's
host who read the reply, and when (a reply can be steered by a fetched page into carrying a
tracking pixel). It shows a placeholder, and on a click loads the image from this route. The
route fetches only an address that one of this conversation's replies holds (through the one
owner check), under web_fetch's address rules and FETCH_MAX_BYTES (`webfetch.fetch_image`), and
answers only a PNG, JPEG, GIF or WebP, typed by its own bytes; so the page's CSP stays
`default-src 'self'`.
"""

from __future__ import annotations

from typing import Annotated

import httpx
from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response

from chatserver.api.deps import OwnerStoreDep, StateDep
from chatserver.tools import webfetch

router = APIRouter(tags=["conversations"])

URL_MAX = 2048


def in_a_reply(conv: dict, url: str) -> bool:
    """Whether one of the conversation's replies (kept or folded away) holds this address."""
    return any(m.get("role") == "assistant" and url in (m.get("content") or "")
               for m in conv["messages"] + conv.get("archive", []))


@router.get("/api/conversations/{conv_id}/remote-image", response_class=Response,
            responses={200: {"content": {"image/png": {}, "image/jpeg": {}, "image/gif": {}, "image/webp": {}}}})
async def remote_image(conv_id: str, url: Annotated[str, Query(min_length=1, max_length=URL_MAX)],
                       store: OwnerStoreDep, state: StateDep) -> Response:
    if not in_a_reply(await store.get(conv_id), url):
        return JSONResponse({"detail": "no reply of this conversation shows that image"}, status_code=404)
    settings = state.settings
    try:
        body, kind = await webfetch.fetch_image(url, max_bytes=settings.fetch_max_bytes, timeout=settings.tool_timeout,
                                                allow_hosts=settings.fetch_allow_hosts)
    except webfetch.Refused as exc:
        return JSONResponse({"detail": str(exc)}, status_code=403)
    except webfetch.FetchError as exc:
        return JSONResponse({"detail": str(exc)}, status_code=502)
    except (httpx.HTTPError, OSError) as exc:  # the host did not answer well
        return JSONResponse({"detail": f"the image could not be fetched ({type(exc).__name__})"}, status_code=502)
    # Private: the person's own view of a reply; `inline` so the page's <img> shows it. Bytes from
    # another site on this origin: opened on their own (a new tab) they may run nothing.
    return Response(body, media_type=kind, headers={"Cache-Control": "private, max-age=3600",
                                                    "Content-Disposition": "inline",
                                                    "Content-Security-Policy": "default-src 'none'; sandbox"})
