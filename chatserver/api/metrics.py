"""GET /metrics (issue 30): the Prometheus text format, for admins and for a scraper holding METRICS_TOKEN.

The Guard lets /metrics through unauthenticated (a scraper has no session), so this route
decides alone: the bearer token first, then whoever the request otherwise is, who must be an admin.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, HTTPException, Request, Response

from chatserver import metrics
from chatserver.accounts.auth import current_user

router = APIRouter()


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"},
                       401: {"description": "neither METRICS_TOKEN nor a login"},
                       403: {"description": "logged in, but not an admin"}})
async def scrape(request: Request) -> Response:
    settings = request.app.state.chat.settings
    if not metrics.token_matches(request.headers.get("authorization"), settings.metrics_token):
        user = await current_user(request)
        if not user.admin:
            raise HTTPException(403, "only an administrator or a scraper with METRICS_TOKEN may read /metrics")
    # The render's own CPU time, apart from any wait for a busy loop: what a scrape costs the server.
    started = time.thread_time()
    body = metrics.active.exposition()
    spent_ms = (time.thread_time() - started) * 1000
    return Response(body, media_type=metrics.CONTENT_TYPE,
                    headers={"Cache-Control": "no-store", "Server-Timing": f"render;dur={spent_ms:.2f}"})
