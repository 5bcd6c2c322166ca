"""The edge where a turn's typed events become the page's SSE frames (API.md's turn stream).

`encode` is the only place that knows event names and payload shapes (and numbers each frame
with its SSE `id`); `TurnResponse` sends a turn's frames. Nothing here knows the pipeline or a
wire format upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from sse_starlette.sse import AppStatus
from starlette.responses import Response

from chatserver import metrics
from chatserver.turns.events import (
    CompareDone,
    CompareStarted,
    Compressed,
    FetchDone,
    ImageAttached,
    LaneEvent,
    ReasoningDelta,
    SearchResults,
    SearchStarted,
    TextDelta,
    ToolStep,
    TurnDone,
    TurnEvent,
    TurnFailed,
    TurnStarted,
    TurnWarning,
)

log = logging.getLogger("chat.streaming")

PING_SECONDS = 15.0  # a comment line after this long without a frame
EXIT_POLL_SECONDS = 0.5


def frame(name: str, data: dict, seq: int | None = None) -> bytes:
    """One SSE record, encoded once here.

    Compact JSON holds no line break, so `data` is always one line. `seq` becomes the record's
    `id:`, which a browser sends back as `Last-Event-ID` when it reconnects.
    """
    head = b"id: %d\r\n" % seq if seq is not None else b""
    return head + b"event: " + name.encode() + b"\r\ndata: " + orjson.dumps(data) + b"\r\n\r\n"


def payload(event: TurnEvent) -> dict | None:
    """The `data` of the page's event for one turn event; None for events the page never sees."""
    match event:
        case TextDelta(text=text) | ReasoningDelta(text=text):
            return {"text": text}
        case SearchStarted(query=query):
            return {"query": query, "results": None}
        case SearchResults(query=query, results=results, error_code=error_code):
            data = {"query": query, "results": results}
            if error_code:
                data["error"] = error_code
            return data
        case FetchDone(url=url, title=title, ok=ok, error_code=error_code):
            data = {"url": url, "title": title, "ok": ok}
            if error_code:
                data["error"] = error_code
            return data
        case ToolStep(data=data):
            return data
        case ImageAttached(attachment=attachment):
            return {"attachment": attachment}
        case TurnWarning(code=code, message=message):
            return {"code": code, "message": message}
        case TurnStarted(assistant_message_id=assistant, model=model, user_message_id=user, masked=masked):
            data = {"assistant_message_id": assistant, "model": model}
            if masked is not None:
                data["masked"] = masked
            return {"user_message_id": user, **data} if user else data
        case Compressed(data=data):
            return data
        case TurnFailed():
            data = {"kind": event.kind, "message": event.message, "retryable": event.retryable,
                    "retry_after": event.retry_after, "partial": event.partial}
            if event.draft is not None:
                data["draft"] = event.draft
            return data
        case TurnDone():
            return {"assistant_message_id": event.assistant_message_id, "usage": event.usage,
                    "citations": event.citations, "status": event.status}
        case CompareStarted(user_message_id=user, replies=replies, masked=masked):
            data = {"user_message_id": user, "assistant_message_id": replies[0]["assistant_message_id"],
                    "model": replies[0]["model"], "compare": list(replies)}
            if masked is not None:
                data["masked"] = masked
            return data
        case LaneEvent(assistant_message_id=assistant, event=inner):
            data = payload(inner)
            return None if data is None else {**data, "assistant_message_id": assistant}
        case CompareDone(replies=replies, status=status):
            return {"assistant_message_id": None, "usage": None, "citations": [], "status": status,
                    "compare": list(replies)}
    return None


def name_of(event: TurnEvent) -> str:
    return NAMES[event.event.type] if isinstance(event, LaneEvent) else NAMES[event.type]


NAMES = {"delta": "delta", "reasoning": "reasoning", "search_started": "search", "search_results": "search",
         "fetch": "fetch", "tool": "tool", "warning": "warning", "start": "start", "compression": "compression",
         "error": "error", "done": "done", "image": "image"}


def encode(event: TurnEvent, seq: int | None = None) -> bytes | None:
    """The SSE frame the page sees for one event (numbered `seq` within its turn), if any."""
    data = payload(event)
    return None if data is None else frame(name_of(event), data, seq)


class TurnResponse(Response):
    """A turn's SSE frames; `closed` runs however the response ends, even if the client left before it started.

    A stream is held open for minutes and sends a frame per token, so this sends each frame
    straight to the server, where sse-starlette's response spent a cancel scope with a timer
    and four tasks per response on the same work. One task sends the frames; the handler's own
    watches for the client leaving, the server stopping, a reader that takes over
    `send_timeout` seconds to accept a frame (dropped: a frozen tab, a dead network path) and
    PING_SECONDS without a frame (a comment line then keeps proxies from closing it).
    """

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[bytes], closed: Callable[[], Awaitable[object]] | None = None,
                 send_timeout: float | None = None) -> None:
        super().__init__(headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no", "Connection": "keep-alive"})
        # Response counts its (empty) body; a stream has no length.
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.frames = frames
        self._closed = closed
        self.send_timeout = send_timeout
        self._sending_since: float | None = None  # when the frame being sent was handed over
        self._last_sent = 0.0

    async def __call__(self, scope, receive, send) -> None:
        metrics.active.streams_open.inc()
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if scope["method"] == "HEAD":
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            await self._follow(receive, send)
        finally:
            metrics.active.streams_open.dec()
            with contextlib.suppress(Exception):
                await _aclose(self.frames)
            if self._closed is not None:
                await self._closed()

    async def _follow(self, receive, send) -> None:
        loop = asyncio.get_running_loop()
        self._last_sent = loop.time()
        pump = asyncio.ensure_future(self._pump(send))
        left = asyncio.ensure_future(_disconnected(receive))
        stopping = _stopping_signal()
        try:
            while True:
                done, _ = await asyncio.wait((pump, left, stopping), timeout=self._tick(loop.time()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if pump in done:
                    pump.result()
                    return
                if done:
                    return  # the client left, or the server is stopping
                now = loop.time()
                if self._sending_since is not None and self.send_timeout is not None \
                        and now - self._sending_since > self.send_timeout:
                    log.info("dropped a turn stream whose reader accepted nothing for %ss", self.send_timeout)
                    return
                if self._sending_since is None and now - self._last_sent >= PING_SECONDS:
                    self._last_sent = now
                    if not await self._ping(send):
                        log.info("dropped a turn stream whose reader accepted no ping for %ss", self.send_timeout)
                        return
        finally:
            left.cancel()
            stopping.cancel()
            if not pump.done():
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump

    def _tick(self, now: float) -> float:
        # Until the next ping is due, counted from the last frame sent (not from this wait).
        ping = PING_SECONDS if self._sending_since is not None else max(self._last_sent + PING_SECONDS - now, 0.0)
        return ping if self.send_timeout is None else min(ping, self.send_timeout / 2)

    async def _ping(self, send) -> bool:
        """Sends a comment line; False if the reader took over `send_timeout` to accept it (while
        this send waits, nothing watches for a hang-up or a stopping server, so it is bounded too)."""
        try:
            async with asyncio.timeout(self.send_timeout):
                await send({"type": "http.response.body", "body": b": ping\r\n\r\n", "more_body": True})
        except TimeoutError:
            return False
        return True

    async def _pump(self, send) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for chunk in self.frames:
                self._sending_since = loop.time()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self._last_sent, self._sending_since = self._sending_since, None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await _aclose(self.frames)


async def _aclose(frames: AsyncIterator[bytes]) -> None:
    aclose = getattr(frames, "aclose", None)
    if aclose is not None:
        await aclose()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


_stopping: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Event] = weakref.WeakKeyDictionary()


def _stopping_signal() -> asyncio.Future:
    """Done once the server is stopping (uvicorn's exit, as sse-starlette hooks it), so open streams
    end and the server can; one watcher per event loop polls for it."""
    loop = asyncio.get_running_loop()
    if (stopping := _stopping.get(loop)) is None:
        stopping = _stopping[loop] = asyncio.Event()
        watcher = asyncio.ensure_future(_watch_exit(stopping))
        _watchers.add(watcher)
        watcher.add_done_callback(_watchers.discard)
    return asyncio.ensure_future(stopping.wait())


_watchers: set[asyncio.Future] = set()  # held, so the watcher task is not collected


async def _watch_exit(stopping: asyncio.Event) -> None:
    while not AppStatus.should_exit:
        await asyncio.sleep(EXIT_POLL_SECONDS)  # uvicorn says it only by this flag
    stopping.set()
