"""Guards in front of every route: Host allow-list, Origin check, access token, body limits.

A server on localhost is still reachable from every page the person has open (cross-site
requests) and from any name that resolves to 127.0.0.1 (DNS rebinding), so each request is
checked here before a route sees it. Written as plain ASGI so streamed responses and
disconnect detection pass through untouched.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import orjson

from config import Settings

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "[::1]", "::1"}
STATE_CHANGING = {"POST", "PUT", "PATCH", "DELETE"}
TOKEN_COOKIE = "chat_token"
# Reachable without the token, so a person can open the page and log in.
PUBLIC_PATHS = {"/", "/healthz", "/api/login"}


def _host_name(value: str) -> str:
    """The host part of a Host header or an Origin's netloc, lower-cased, without port."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _json_error(status: int, detail: str) -> list[dict]:
    body = orjson.dumps({"detail": detail})
    return [
        {"type": "http.response.start", "status": status,
         "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]},
        {"type": "http.response.body", "body": body},
    ]


def allowed_hosts(settings: Settings) -> set[str]:
    hosts = LOOPBACK_NAMES | set(settings.allowed_hosts)
    if not settings.is_loopback:
        hosts.add(_host_name(settings.host))
    return hosts


class Guard:
    """ASGI middleware; reads the settings that lifespan put on `app.state.chat`."""

    def __init__(self, app: Callable) -> None:
        self.app = app
        self.settings: Settings | None = None
        self.allowed_hosts: set[str] = set()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.settings is None:
            self.settings = scope["app"].state.chat.settings
            self.allowed_hosts = allowed_hosts(self.settings)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        method = scope["method"].upper()
        problem = self._check(scope, headers, method)
        if problem:
            return await self._reply(send, *problem)
        if method in STATE_CHANGING:
            body, problem = await self._read_body(headers, receive)
            if problem:
                return await self._reply(send, *problem)
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _check(self, scope: dict, headers: dict, method: str) -> tuple[int, str] | None:
        host = _host_name(headers.get("host", ""))
        if host not in self.allowed_hosts:
            return 400, "unknown Host header; add it to ALLOWED_HOSTS if you serve this app under that name"
        if method in STATE_CHANGING and "origin" in headers:
            origin = headers["origin"]
            parts = urlsplit(origin) if origin != "null" else None
            if parts is None or parts.scheme not in ("http", "https") \
                    or parts.netloc.lower() != headers.get("host", "").lower():
                return 403, "cross-origin request refused"
        token = self.settings.access_token
        if token and scope["path"] not in PUBLIC_PATHS and not scope["path"].startswith("/static/"):
            offered = _offered_token(headers)
            if not (offered and hmac.compare_digest(offered.encode(), token.encode())):
                return 401, "this server needs its access token (Authorization: Bearer, or log in on the page)"
        return None

    async def _read_body(self, headers: dict, receive: Callable) -> tuple[bytes, tuple[int, str] | None]:
        limit = self.settings.max_request_bytes
        too_big = (413, f"request body over {limit} bytes")
        declared = headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            return b"", too_big
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return b"", too_big
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        if body:
            try:
                orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                return body, (422, f"malformed JSON body: {exc}")
        return body, None

    @staticmethod
    async def _reply(send: Callable, status: int, detail: str) -> None:
        for message in _json_error(status, detail):
            await send(message)


def _offered_token(headers: dict) -> str | None:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    for part in headers.get("cookie", "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == TOKEN_COOKIE:
            return value
    return None


def _replay(body: bytes, receive: Callable) -> Callable[[], Awaitable[dict]]:
    """A receive() that hands the buffered body over once, then listens for disconnect."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
