"""Guards in front of every route: Host allow-list, Origin check, who is asking (auth.py), body bounds.

A server on localhost is still reachable from every page the person has open (cross-site
requests) and from any name that resolves to 127.0.0.1 (DNS rebinding), so each request is
checked here before a route sees it. Written as plain ASGI so streamed responses and
disconnect detection pass through untouched.

Every request body is bounded in time (BODY_TIMEOUT from the moment the app gets the request,
then 408) and JSON bodies and imports in size (413 as soon as the limit is passed, nothing more
read). Routes that stream an upload themselves read through the same bounded `receive`.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import orjson
from fastapi import HTTPException

from chatserver.accounts.auth import Throttled, accounts, unauthorised_detail
from chatserver.config import Settings
from chatserver.conversations import exchange
from chatserver.sizes import admin_setting, size_words
from chatserver.store.files import StoreUnavailable

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "[::1]", "::1"}
STATE_CHANGING = {"POST", "PUT", "PATCH", "DELETE"}
# Reachable without logging in, so a person can open the page and log in; /api/auth/me answers
# 401 itself, saying which kind of login the page should offer. The usage page holds no data: its
# script reads /api/usage (guarded) and sends a person who is not logged in to the page's login.
PUBLIC_PATHS = {"/", "/usage", "/healthz", "/api/login", "/api/auth/login", "/api/auth/me", "/metrics"}
# A shared copy is read by whoever holds its link, without an account (api/sharing.py).
PUBLIC_PREFIXES = ("/static/", "/s/", "/api/shared/")
# The page is same-origin modules and one stylesheet with no inline script, so everything else
# is refused: an injected <script>, a plugin, a foreign frame, a <base> or form redirect. data:
# images only for the page's empty favicon (`<link rel="icon" href="data:,">`).
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
# Sent with every answer: no other site may frame the page (clickjacking) or sniff a type into one.
SECURITY_HEADERS = [
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
# Room for the multipart framing and the part's headers around an imported file.
IMPORT_FRAMING_BYTES = 64 * 1024
# A cut body leaves unread bytes on the connection: it cannot carry a next request.
_CLOSE = {"Connection": "close"}
# A whole Host header: a name or a bracketed IPv6 literal, then at most a numeric port.
_HOST = re.compile(r"(?P<name>\[[0-9a-f:.]+\]|[a-z0-9._-]+)(?::[0-9]{1,5})?")


def _host_name(value: str) -> str | None:
    """The host part of a Host header, lower-cased, without port; None when it is not a plain host[:port]."""
    match = _HOST.fullmatch(value.strip().lower())
    return match["name"] if match else None


def _json_error(status: int, detail: str, retry_after: int | None = None,
                headers: dict[str, str] | None = None) -> list[dict]:
    body = orjson.dumps({"detail": detail})
    extra = [(b"retry-after", str(retry_after).encode())] if retry_after else []
    extra += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return [
        {"type": "http.response.start", "status": status,
         "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                     *extra]},
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
        deadline = asyncio.get_running_loop().time() + self.settings.body_timeout
        problem = self._check(scope, headers, method) or await self._authenticate(scope, headers)
        if problem:
            return await self._reply(send, *problem)
        if method in STATE_CHANGING and not _is_upload(scope["path"], headers):
            limit = self.settings.max_request_bytes
        elif scope["path"] == "/api/import":
            limit = exchange.MAX_IMPORT_BYTES + IMPORT_FRAMING_BYTES
        else:
            limit = None  # an attachment's route counts its own bytes, under MAX_ATTACHMENT_BYTES
        declared = headers.get("content-length", "")
        if limit is not None and declared.isdigit() and int(declared) > limit:
            return await self._reply(send, 413, _too_big(limit, scope["path"]), headers=_CLOSE)
        if declared not in ("", "0") or "transfer-encoding" in headers:  # there is a body to wait for
            receive = _bounded(receive, limit, deadline, self.settings.body_timeout, scope["path"])
        if method in STATE_CHANGING and not _is_upload(scope["path"], headers):
            try:
                body, problem = await self._read_body(receive)
            except HTTPException as exc:
                return await self._reply(send, exc.status_code, exc.detail, headers=exc.headers)
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
        return None

    async def _authenticate(self, scope: dict, headers: dict) -> tuple | None:
        """Who is asking (auth.Accounts.authenticate), kept in scope["state"]["chat_user"] for the routes."""
        if scope["path"] in PUBLIC_PATHS or scope["path"].startswith(PUBLIC_PREFIXES):
            return None
        try:
            user = await accounts(scope["app"]).authenticate(scope, headers)
        except Throttled as exc:
            return 429, str(exc), exc.retry_after
        except StoreUnavailable as exc:  # sessions live in Redis (STORE=redis): the app's own 503
            logging.getLogger("chat.server").error("%s", exc)
            return 503, "the conversation store (Redis) is unreachable; try again shortly"
        if user is None:
            return 401, unauthorised_detail(self.settings)
        scope.setdefault("state", {})["chat_user"] = user
        return None

    @staticmethod
    async def _read_body(receive: Callable) -> tuple[bytes, tuple[int, str] | None]:
        """The whole body through the bounded receive (HTTPException past its size or time)."""
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunks.append(message.get("body", b""))
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
    async def _reply(send: Callable, status: int, detail: str, retry_after: int | None = None,
                     headers: dict[str, str] | None = None) -> None:
        for message in _json_error(status, detail, retry_after, headers):
            await send(message)


def _too_big(limit: int, path: str) -> str:
    if path == "/api/import":
        return (f"the file is larger than {size_words(exchange.MAX_IMPORT_BYTES)}, the most one import may be; "
                "import a ChatGPT export's conversations.json on its own rather than the whole zip")
    return (f"the request is larger than {size_words(limit)}, the most this server takes in one request "
            f"({admin_setting('MAX_REQUEST_BYTES')}); a long text goes in better as an attached file")


def _bounded(receive: Callable, limit: int | None, deadline: float, timeout: float, path: str) -> Callable:
    """A receive() that answers 408 (HTTPException) once the body is not in by `deadline`, and 413
    as soon as it passes `limit` bytes (`path` picks its words); once the body is complete it waits
    unbounded (for disconnect)."""
    received, complete = 0, False

    async def bounded() -> dict:
        nonlocal received, complete
        if complete:
            return await receive()
        try:
            async with asyncio.timeout_at(deadline):  # no task per call, unlike wait_for
                message = await receive()
        except TimeoutError:
            raise HTTPException(408, f"the request body took longer than {timeout:g} s to arrive",
                                headers=_CLOSE) from None
        if message["type"] != "http.request" or not message.get("more_body"):
            complete = True
        received += len(message.get("body", b""))
        if limit is not None and received > limit:
            raise HTTPException(413, _too_big(limit, path), headers=_CLOSE)
        return message

    return bounded


def _is_upload(path: str, headers: dict) -> bool:
    """A multipart file upload: its route streams the body itself under MAX_ATTACHMENT_BYTES."""
    return headers.get("content-type", "").lower().startswith("multipart/form-data") and (
        path.endswith("/attachments") or path in ("/api/library", "/api/import")
        or (path.startswith("/api/projects/") and path.endswith("/files")))


def _with_security_headers(send: Callable) -> Callable[[dict], Awaitable[None]]:
    async def send_with_headers(message: dict) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            present = {name.lower() for name, _ in headers}
            # A route may set one itself (downloads send nosniff): each is sent once.
            headers += [(name, value) for name, value in SECURITY_HEADERS if name not in present]
            message = {**message, "headers": headers}
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
