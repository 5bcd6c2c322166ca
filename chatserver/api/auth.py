"""Login, logout and "who am I" (API.md, People), and the ACCESS_TOKEN login the page uses.

Routes only translate: auth.Accounts decides who is who. The Guard has already checked Host and
Origin; /api/auth/login and /api/auth/me are public there and answer for themselves.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from chatserver.accounts.auth import (
    SESSION_COOKIE,
    TOKEN_COOKIE,
    Accounts,
    Throttled,
    WrongCredentials,
    accounts,
    cookie,
    request_origin,
    unauthorised_detail,
)

router = APIRouter()
WRONG = "wrong user name or password"


class AccountLogin(BaseModel):
    model_config = ConfigDict(extra="forbid")
    username: StrictStr = Field(min_length=1, max_length=200)
    password: StrictStr = Field(min_length=1, max_length=1000)


def _headers(request: Request) -> dict:
    return {k.lower(): v for k, v in request.headers.items()}


def _throttled(exc: Throttled) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=429, headers={"Retry-After": str(exc.retry_after)})


def _with_cookie(request: Request, name: str, session_id: str, samesite: str) -> Response:
    settings = request.app.state.chat.settings
    response = Response(status_code=204)
    response.set_cookie(name, session_id, max_age=int(settings.session_hours * 3600), httponly=True,
                        samesite=samesite, secure=request_origin(request.scope, settings).https, path="/")
    return response


@router.post("/api/auth/login", status_code=204,
             responses={401: {"description": WRONG}, 429: {"description": "too many failed attempts"}})
async def login(body: AccountLogin, request: Request) -> Response:
    """Trade a user name and password for an HttpOnly, SameSite=Lax session cookie."""
    gate: Accounts = accounts(request.app)
    if gate.settings.auth != "password":
        return JSONResponse({"detail": f"accounts are not kept by this server (AUTH={gate.settings.auth})"},
                            status_code=400)
    try:
        session_id = await gate.login(body.username, body.password, request_origin(request.scope, gate.settings).address)
    except Throttled as exc:
        return _throttled(exc)
    except WrongCredentials:
        return JSONResponse({"detail": WRONG}, status_code=401)
    return _with_cookie(request, SESSION_COOKIE, session_id, "lax")


@router.post("/api/auth/logout", status_code=204)
async def logout(request: Request) -> Response:
    """End this browser's session and clear its cookie."""
    headers = _headers(request)
    gate = accounts(request.app)
    for name in (SESSION_COOKIE, TOKEN_COOKIE):
        await gate.logout(cookie(headers, name))
    response = Response(status_code=204)
    for name in (SESSION_COOKIE, TOKEN_COOKIE):
        response.delete_cookie(name, path="/", httponly=True)
    return response


@router.get("/api/auth/me", responses={401: {"description": "nobody is logged in"}})
async def me(request: Request) -> Response:
    """Who is logged in; a 401 says which login the page should offer (`"login": "password" | "token" | "header"`)."""
    gate = accounts(request.app)
    try:
        user = await gate.authenticate(request.scope, _headers(request))
    except Throttled as exc:
        return _throttled(exc)
    if user is None:
        login_kind = "token" if gate.settings.auth == "none" else gate.settings.auth
        return JSONResponse({"detail": unauthorised_detail(gate.settings), "login": login_kind}, status_code=401)
    return JSONResponse({"username": user.name, "admin": user.admin})


async def token_login(request: Request, offered: str) -> Response:
    """POST /api/login: trade ACCESS_TOKEN for a random, expiring session id (SameSite=Strict cookie)."""
    gate = accounts(request.app)
    if gate.settings.access_token is None or gate.settings.auth != "none":
        return Response(status_code=204)  # nothing to log in to
    try:
        session_id = await gate.login_token(offered, request_origin(request.scope, gate.settings).address)
    except Throttled as exc:
        return _throttled(exc)
    except WrongCredentials:
        return JSONResponse({"detail": "wrong access token"}, status_code=401)
    return _with_cookie(request, TOKEN_COOKIE, session_id, "strict")

