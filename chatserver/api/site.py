"""The page itself, the health check and the access-token login."""

from __future__ import annotations

import os

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from chatserver.api import auth as auth_routes
from chatserver.api.deps import StateDep
from chatserver.api.schemas import Health, Login
from chatserver.config import PACKAGE
from chatserver.upstream.probe import gateway_reachable

STATIC = PACKAGE / "static"

router = APIRouter()


class RevalidatedStatic(StaticFiles):
    """The page's modules, revalidated on every load so an upgrade never mixes old and new files."""

    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response


@router.get("/", include_in_schema=False)
async def page() -> Response:
    index = STATIC / "index.html"
    if not index.exists():
        return JSONResponse({"detail": "the page is not built"}, status_code=404)
    return FileResponse(index, headers={"Cache-Control": "no-cache"})


@router.get("/usage", include_in_schema=False)
async def usage_page() -> Response:
    """The usage page (issue 28): spend, tokens and budgets, drawn from GET /api/usage."""
    return FileResponse(STATIC / "usage.html", headers={"Cache-Control": "no-cache"})


@router.get("/healthz", response_model=Health)
async def healthz(state: StateDep, request: Request) -> dict:
    configured = state.settings.gateway_configured
    reachable = await gateway_reachable(state.settings.gateway_base_url, state.turns.gateway.client)
    return {"ok": True, "gateway_configured": configured, "gateway": "configured" if configured else "demo",
            "gateway_reachable": reachable, "search": request.app.state.search.state,
            "worker": request.app.state.worker, "workers": state.settings.workers, "pid": os.getpid(),
            "sharing": state.settings.allow_sharing}


@router.post("/api/login", status_code=204, responses={401: {"description": "wrong access token"}})
async def login(body: Login, request: Request) -> Response:
    """Trade ACCESS_TOKEN for an HttpOnly, SameSite=Strict session cookie (random, expiring)."""
    return await auth_routes.token_login(request, body.token)
