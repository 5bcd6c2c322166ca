"""Guards in front of every route: Host allow-list, Origin check, access token, body limits.

A server on localhost is still reachable from every page the person has open (cross-site
requests) and from any name that resolves to 127.0.0.1 (DNS rebinding), so each request is
checked here before a route sees it. Written as plain ASGI so streamed responses and
disconnect detection pass through untouched.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import orjson

from config import Settings

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "[::1]", "::1"}
STATE_CHANGING = {"POST", "PUT", "PATCH", "DELETE"}
TOKEN_COOKIE = "chat_token"
# Reachable without the token, so a person can open the page and log in.
PUBLIC_PATHS = {"/", "/healthz", "/api/login"}
# Sent with every answer: no other site may frame the page (clickjacking) or sniff a type into one.
SECURITY_HEADERS = [
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy", b"frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
# A whole Host header: a name or a bracketed IPv6 literal, then at most a numeric port.
_HOST = re.compile(r"(?P<name>\[[0-9a-f:.]+\]|[a-z0-9._-]+)(?::[0-9]{1,5})?")


def _host_name(value: str) -> str | None:
    """The host part of a Host header, lower-cased, without port; None when it is not a plain host[:port]."""
    match = _HOST.fullmatch(value.strip().lower())
    return match["name"] if match else None


def login_cookie(token: str) -> str:
    """The login cookie's value: derived from the token, so a copied cookie jar does not hold the token."""
    return hmac.new(token.encode(), b"chat-server login cookie", hashlib.sha256).hexdigest()


def token_matches(offered: str, token: str) -> bool:
    return hmac.compare_digest(offered.encode(), token.encode())


def _json_error(status: int, detail: str) -> list[dict]:
    body = orjson.dumps({"detail": detail})
    return [
        {"type": "http.response.start", "status": status,
         "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]},
        {"type": "http.response.body", "body": body},
    ]


def allowed_hosts(settings: Settings) -> set[str]:
    hosts = LOOPBACK_NAMES | {h for h in map(_host_name, settings.allowed_hosts) if h}
    bound = settings.host.strip()
    # The address the server binds is a name it answers to (127.0.0.2, a LAN address with a token).
    if bound and (name := _host_name(f"[{bound.strip('[]')}]" if ":" in bound else bound)):
        hosts.add(name)
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
        send = _with_security_headers(send)
        if self.settings is None:
            self.settings = scope["app"].state.chat.settings
            self.allowed_hosts = allowed_hosts(self.settings)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        method = scope["method"].upper()
        problem = self._check(scope, headers, method)
        if problem:
            return await self._reply(send, *problem)
        if method in STATE_CHANGING and not _is_upload(scope["path"], headers):
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
            if not _authorised(headers, token):
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


def _is_upload(path: str, headers: dict) -> bool:
    """A multipart file upload: its route streams the body itself under MAX_ATTACHMENT_BYTES."""
    return headers.get("content-type", "").lower().startswith("multipart/form-data") and (
        path.endswith("/attachments") or path in ("/api/library", "/api/import"))


def _authorised(headers: dict, token: str) -> bool:
    """The token as `Authorization: Bearer`, or the login cookie derived from it (constant-time compares)."""
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer " and token_matches(auth[7:].strip(), token):
        return True
    for part in headers.get("cookie", "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == TOKEN_COOKIE and token_matches(value, login_cookie(token)):
            return True
    return False


def _with_security_headers(send: Callable) -> Callable[[dict], Awaitable[None]]:
    async def send_with_headers(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
        await send(message)

    return send_with_headers


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
